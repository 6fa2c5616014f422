"""How fast this host runs the services' Python, as one number a benchmark records beside its figures.

A speculative step's time outside the GPU (the gateway's bookkeeping, message conversion, the
drafter's and verifier's host preparation) is per-request Python, and GPU machines of one kind
differ in it: on two H100 hosts a session apart a chain k=4 step at batch 32 took 21.6 and 25.7
ms (the builds differed only off the GPU), mode off's 9.4 and 10.5, and the second host ran this
workload 3.5-4x slower than the dev VM. Comparing runs from different hosts needs this figure.

The workload is fixed: per-request records built, looked up and updated the way a step treats its
batch (dicts, lists, small objects), no I/O, no C extensions. Its median wall time over a few
repeats, in ms (lower is faster).

    python -m benchmarks.host_speed
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class _Request:
    seq_id: str
    tokens: list[int] = field(default_factory=list)
    accepted: int = 0


def _workload(batch: int = 64, steps: int = 200) -> int:
    """A batch of requests stepped `steps` times: verdicts applied, counts kept, a message-like dict
    per request built. -> a checksum (keeps the work from being skipped)."""
    requests = {f"s{i:04d}": _Request(f"s{i:04d}") for i in range(batch)}
    stats: dict[str, int] = {}
    total = 0
    for step in range(steps):
        items = [{"seq_id": r.seq_id, "committed_len": len(r.tokens), "append_ids": r.tokens[-4:]}
                 for r in requests.values()]
        for item in items:
            r = requests[item["seq_id"]]
            accepted = (step + len(r.tokens)) % 5
            r.tokens += [step, accepted][: 1 + accepted % 2]
            r.accepted += accepted
            stats[r.seq_id] = stats.get(r.seq_id, 0) + accepted
            total += item["committed_len"]
        if step % 50 == 49:   # requests end and new ones join
            for sid in list(requests)[: batch // 4]:
                requests[sid].tokens.clear()
    return total + sum(stats.values())


def host_python_ms(repeats: int = 7) -> float:
    """Median wall ms of the fixed workload (about 4.3 ms on the dev VM)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _workload()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cpu_model() -> str:
    """The CPU's model name (Linux), else the platform's processor string."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> str:
    """The host in a run's machine line: its CPU and how fast it runs this workload."""
    return f"{cpu_model()}, host Python {host_python_ms():.1f} ms"


if __name__ == "__main__":
    print(f"{describe()} (benchmarks/host_speed.py)")
