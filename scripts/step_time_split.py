"""Where a step's time went on each side of the wire, from debug logs (SPECDEC_LOG_LEVEL=debug): the
gateway's "scheduler step" lines joined by step number with the verifier's and the drafter's
"engine step" lines. Per mode (a benchmark runs one at a time), kind of step and batch bucket: the
whole step, the draft and verify round trips, and for each service its decoding of the request, the
engine, the encoding of the result, and the rest of its round trip ("wire": gRPC's serialization
and parsing, the transfer, the event loops' turns), and the gateway's own share (the step less both
round trips).

    python scripts/step_time_split.py GATEWAY_LOG VERIFIER_LOG DRAFTER_LOG
    python scripts/step_time_split.py w/gateway-a0.8.log w/verifier.log w/drafter-a0.8.log --modes chain off
"""

from __future__ import annotations

import argparse
import gzip
import sys
from collections import defaultdict
from pathlib import Path
from statistics import mean

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # allow running without installing

from gateway.auto.costs import bucket  # noqa: E402
from scripts.auto_log_summary import _FIELD, by_mode  # noqa: E402

SIDE = ("decode_ms", "thread_ms", "encode_ms")


def read_lines(path: str) -> list[str]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        return f.readlines()


def engine_steps(path: str) -> dict[int, dict[str, float]]:
    """step number -> the engine's split of it (ms)."""
    out = {}
    for line in read_lines(path):
        if "engine step" in line:
            f = dict(_FIELD.findall(line))
            out[int(f["step"])] = {k: float(f[k]) for k in SIDE}
    return out


def kind(f: dict[str, str]) -> str:
    if int(f["admitted"]):
        return "admitting"
    if f["prefilling"] == "True":
        return "prefilling"
    return "speculating" if int(f["drafting"]) else "off"


def split(lines: list[str], verifier: dict, drafter: dict) -> dict[tuple[str, int], list[list[float]]]:
    """(kind, bucket) -> per step: [step, draft rtt, verify rtt, gateway, verifier decode, engine
    thread, encode, wire, drafter decode, thread, encode, wire] (ms)."""
    rows = defaultdict(list)
    for line in lines:
        if "scheduler step" not in line:
            continue
        f = dict(_FIELD.findall(line))
        if "step" not in f:
            continue
        step, draft, verify = float(f["ms"]), float(f["draft_ms"]), float(f["verify_ms"])
        v = verifier.get(int(f["step"]), dict.fromkeys(SIDE, 0.0))
        d = drafter.get(2 * int(f["step"])) if draft > 0 else None
        d = d or dict.fromkeys(SIDE, 0.0)
        rows[(kind(f), bucket(int(f["batch"])))].append([
            step, draft, verify, step - draft - verify,
            *(v[k] for k in SIDE), verify - sum(v.values()),
            *(d[k] for k in SIDE), (draft - sum(d.values())) if draft > 0 else 0.0])
    return rows


def table(rows: dict[tuple[str, int], list[list[float]]]) -> list[str]:
    out = ["| step kind | batch | steps | step ms | draft rtt | verify rtt | gateway | verifier: decode / engine "
           "thread / encode / wire | drafter: decode / engine thread / encode / wire |",
           "|---|---|---|---|---|---|---|---|---|"]
    for (k, b), steps in sorted(rows.items()):
        m = [mean(c) for c in zip(*steps)]
        out.append(f"| {k} | {b} | {len(steps)} | {m[0]:.2f} | {m[1]:.2f} | {m[2]:.2f} | {m[3]:.2f} | "
                   + " / ".join(f"{x:.2f}" for x in m[4:8]) + " | " + " / ".join(f"{x:.2f}" for x in m[8:12]) + " |")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("gateway_log")
    p.add_argument("verifier_log")
    p.add_argument("drafter_log")
    p.add_argument("--modes", nargs="*", help="only these modes' blocks (by_mode's labels start with the mode)")
    a = p.parse_args(argv)
    verifier, drafter = engine_steps(a.verifier_log), engine_steps(a.drafter_log)
    for label, lines in sorted(by_mode(read_lines(a.gateway_log)).items()):
        if a.modes and label.split(" x ")[0] not in a.modes:
            continue
        print(f"\n{label}\n")
        print("\n".join(table(split(lines, verifier, drafter))))


if __name__ == "__main__":
    main()
