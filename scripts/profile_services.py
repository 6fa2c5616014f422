"""Where each service's host time goes during a benchmark row: runs `python -m benchmarks.sweep` with
the arguments after `--`, and once its rows start, samples the verifier, drafter and gateway processes
with py-spy (https://github.com/benfred/py-spy; `pip install py-spy`) for a while. Then it prints, per
service, the share of samples under each function of this repository: inclusive (the function and what
it calls), and by line for the heaviest ones. Time a process spends idle is not sampled, so the shares
are of its busy time; the samples per second over the rate say how busy it was.

    python scripts/profile_services.py --seconds 10 --out-dir /tmp/spy -- --device cuda --parts random \\
        --eagle3-drafter --acceptance 0.8 --concurrency 32 --modes "chain k=4 no-overlap" \\
        --requests-per-client 40 --waves 1 --no-report

Give the row enough requests to outlast the sampling (the sampling starts a few seconds into the rows).
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROLES = ("verifier", "drafter", "gateway")
ROWS_STARTED = "rows]"   # the sweep's progress bar once its rows run


def service_pids(parent: int) -> dict[str, int]:
    """The first process of each role among `parent`'s descendants (from /proc)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    cmdlines: dict[int, str] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdlines[int(proc.name)] = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue
        children[ppid].append(int(proc.name))
    found: dict[str, int] = {}
    todo = [parent]
    while todo:
        pid = todo.pop()
        for role in ROLES:
            if f"specdec.cli {role}" in cmdlines.get(pid, "") and role not in found:
                found[role] = pid
        todo += children.get(pid, [])
    return found


def ours(path: str, root: str) -> str | None:
    """A frame's path relative to the repository, or None for library code. py-spy prints paths
    relative to the sys.path entry they were found under, so a repository file may come as
    'specdec/x.py' (editable install) or absolute."""
    rel = path[len(root):].lstrip("/") if path.startswith(root + "/") else path
    return rel if not rel.startswith("/") and (Path(root) / rel).is_file() else None


def frame_key(frame: str) -> tuple[str, str, str]:
    """A py-spy raw frame 'function (path:line)' -> (function, path, line)."""
    name, _, where = frame.partition(" (")
    path, _, line = where.rstrip(")").rpartition(":")
    return name, path, line


def stacks(raw: str):
    """py-spy's raw output ('frame;frame;... count' per line) -> (frames, count) per stack."""
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if stack and count.isdigit():
            yield stack.split(";"), int(count)


def summarize(raw: str, root: str, top: int = 25) -> list[tuple[float, str]]:
    """py-spy's raw output -> the `top` functions of the repository at `root` by inclusive share of
    all samples: [(share, 'function path'), ...]."""
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for frames, count in stacks(raw):
        total += count
        seen = set()
        for name, path, _ in map(frame_key, frames):
            rel = ours(path, root)
            if rel is not None and f"{name} {rel}" not in seen:   # recursion counts once
                seen.add(f"{name} {rel}")
                inclusive[f"{name} {rel}"] += count
    return [(n / total, key) for key, n in inclusive.most_common(top)] if total else []


def innermost(raw: str, root: str, top: int = 15) -> list[tuple[float, str]]:
    """Each sample charged to the last frame under `root` in its stack: the repository's function
    whose own code, or the library code it called (torch, grpc, ...), was running. [(share, key)]."""
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for frames, count in stacks(raw):
        total += count
        mine = [(name, ours(path, root)) for name, path, _ in map(frame_key, frames)]
        mine = [(name, rel) for name, rel in mine if rel is not None]
        own[f"{mine[-1][0]} {mine[-1][1]}" if mine else "(outside the repository)"] += count
    return [(n / total, key) for key, n in own.most_common(top)] if total else []


def by_line(raw: str, function: str) -> list[tuple[int, str]]:
    """Samples per line of `function` (the innermost frame of it in each stack), with the callee
    that line was in: [(samples, 'line -> callee'), ...]."""
    lines: collections.Counter[str] = collections.Counter()
    for frames, count in stacks(raw):
        hits = [i for i, f in enumerate(frames) if frame_key(f)[0] == function]
        if hits:
            i = hits[-1]
            callee = frame_key(frames[i + 1])[0] if i + 1 < len(frames) else "(itself)"
            lines[f"{frame_key(frames[i])[2]} -> {callee}"] += count
    return [(n, key) for key, n in lines.most_common(8)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--rate", type=int, default=250, help="samples per second")
    p.add_argument("--delay", type=float, default=5.0, help="seconds into the rows before sampling")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out-dir", type=Path, default=Path("profile-services"))
    p.add_argument("sweep_args", nargs=argparse.REMAINDER, help="after --: the arguments of benchmarks.sweep")
    a = p.parse_args()
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        sys.exit("py-spy is not installed: pip install py-spy")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    root = str(Path(__file__).resolve().parents[1])
    args = [x for x in a.sweep_args if x != "--"]
    log = (a.out_dir / "sweep.log").open("w")
    sweep = subprocess.Popen([sys.executable, "-m", "benchmarks.sweep", *args], cwd=root, stdout=log,
                             stderr=subprocess.STDOUT)
    print(f"sweep started (log: {a.out_dir / 'sweep.log'}); waiting for its rows", flush=True)
    while ROWS_STARTED not in (a.out_dir / "sweep.log").read_text(errors="replace"):
        if sweep.poll() is not None:
            sys.exit(f"the sweep ended (code {sweep.returncode}) before its rows started: "
                     f"see {a.out_dir / 'sweep.log'}")
        time.sleep(0.5)
    time.sleep(a.delay)
    pids = service_pids(sweep.pid)
    print(f"sampling {pids} for {a.seconds:.0f} s at {a.rate}/s", flush=True)
    spies = {role: subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(int(a.seconds)),
                                     "--rate", str(a.rate), "--format", "raw", "--nonblocking",
                                     "--output", str(a.out_dir / f"{role}.txt")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for role, pid in pids.items()}
    for s in spies.values():
        s.wait()
    sweep.wait()
    for role in spies:
        raw = (a.out_dir / f"{role}.txt").read_text() if (a.out_dir / f"{role}.txt").exists() else ""
        samples = sum(count for _, count in stacks(raw))
        print(f"\n## {role}: {samples} samples in {a.seconds:.0f} s "
              f"(busy {samples / (a.rate * a.seconds):.0%} of the time)\n")
        print("inclusive (the function and all it calls):")
        for share, key in summarize(raw, root, a.top):
            print(f"{share:6.1%}  {key}")
        print("\ninnermost function of this repository (its own code and the library calls it makes):")
        heavy = innermost(raw, root)
        for share, key in heavy:
            print(f"{share:6.1%}  {key}")
        for _, key in [h for h in heavy if not h[1].startswith("(")][:3]:
            function = key.split(" ")[0]
            print(f"\n  {function}, by line: " + "; ".join(f"{n} at {where}" for n, where in by_line(raw, function)))


if __name__ == "__main__":
    main()
