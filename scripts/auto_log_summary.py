"""What `--mode auto` expected of its steps next to what they took and committed, per choice, from
a gateway's debug log (SPECDEC_LOG_LEVEL=debug: one "auto step" line per measured step), and what
the steps that admitted prompts took over their clean price per prompt, per kind (off,
speculating), next to the figure auto charged a prompt ("auto admitting step" lines), and where
the scheduler's time went, by what its steps did ("scheduler step" lines, every request's mode), with
the drafts' and verifies' round trips next to the engines' own time in them.

    python scripts/auto_log_summary.py /tmp/logs/gateway.log [more logs]
    python scripts/auto_log_summary.py --by-mode /tmp/w/gateway-a0.8.log   # a sweep's gateway: each mode apart
    python scripts/auto_log_summary.py --by-bucket gateway.log   # choices per batch size, and their rivals
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict
from dataclasses import dataclass, field

from gateway.admission import is_wave
from gateway.auto.costs import bucket

_FIELD = re.compile(r"(\w+)=('[^']*'|\S+)")


@dataclass
class ChoiceSteps:
    steps: int = 0
    probes: int = 0
    expected_ms: float = 0.0     # sums over the non-probe steps (a probe has no expectation)
    measured_ms: float = 0.0
    expected_tokens: float = 0.0
    tokens: float = 0.0


@dataclass
class Admissions:
    steps: int = 0
    admitted: int = 0
    excess_ms: float = 0.0       # measured less the clean price, summed
    charged_ms: float = 0.0      # the per-prompt figure auto charged, summed over the steps


def _events(lines, event: str):
    """The fields of each log line of this event."""
    for line in lines:
        if event in line:
            yield {k: v.strip("'") for k, v in _FIELD.findall(line)}


def admissions(lines) -> dict[str, Admissions]:
    """'auto admitting step' lines -> per kind ("off", "speculating")."""
    out: dict[str, Admissions] = defaultdict(Admissions)
    for f in _events(lines, "auto admitting step"):
        a = out["off" if f["choice"] == "off" else "speculating"]
        a.steps += 1
        a.admitted += int(f["admitted"])
        a.excess_ms += float(f["measured_ms"]) - float(f["expected_ms"])
        a.charged_ms += float(f["per_admission_ms"])
    return dict(out)


@dataclass
class StepKind:
    steps: int = 0
    ms: float = 0.0
    longest_ms: float = 0.0
    batch: int = 0               # summed over the steps
    committed: int = 0           # tokens the steps committed (logs before it was logged: 0)
    round_trips: dict[str, float] = field(default_factory=lambda: defaultdict(float))   # summed ms, per field


# The round trips a step line gives, and the engines' share of each (older logs: none of the engine's).
ROUND_TRIPS = ("draft_ms", "draft_engine_ms", "verify_ms", "verify_engine_ms")


def step_kind(f: dict) -> str:
    admitted, batch = int(f["admitted"]), int(f["batch"])
    if admitted:   # (batch: the requests the step continued; the prompts join them)
        return "admitting a wave" if is_wave(admitted, batch + admitted) else "admitting prompts"
    if f["prefilling"] == "True":   # chunks of prompts that earlier steps admitted (a long prompt or a wave)
        return "prefilling earlier prompts"
    if f["released"] == "True":
        return "released (off, rows sent)"
    return "speculating" if int(f["drafting"]) or int(f["predrafting"]) else "off"


def step_kinds(lines) -> dict[str, StepKind]:
    """'scheduler step' lines -> per kind of step: count, wall time, longest, batch."""
    out: dict[str, StepKind] = defaultdict(StepKind)
    for f in _events(lines, "scheduler step"):
        k = out[step_kind(f)]
        ms = float(f["ms"])
        k.steps += 1
        k.ms += ms
        k.longest_ms = max(k.longest_ms, ms)
        k.batch += int(f["batch"])
        k.committed += int(f.get("committed", 0))
        for name in ROUND_TRIPS:
            k.round_trips[name] += float(f.get(name, 0.0))
    return dict(out)


def by_mode(lines) -> dict[str, list[str]]:
    """The lines of a benchmark's log (one mode at a time through the gateway, as benchmarks/sweep.py
    runs them) by the mode of the requests then running and how many started in a row: "auto x 320"
    holds every run of auto whose requests came 320 in a row (one C of the sweep)."""
    blocks: list[tuple[str, int, list[str]]] = []
    for line in lines:
        if "request started" in line:
            mode = dict(_FIELD.findall(line)).get("mode", "?")
            if not blocks or blocks[-1][0] != mode:
                blocks.append((mode, 0, []))
            blocks[-1] = (mode, blocks[-1][1] + 1, blocks[-1][2])
        if blocks:
            blocks[-1][2].append(line)
    out: dict[str, list[str]] = defaultdict(list)
    for mode, started, block in blocks:
        out[f"{mode} x {started}"] += block
    return dict(out)


def print_step_kinds(lines, title: str = "scheduler steps") -> None:
    kinds = step_kinds(lines)
    if not kinds:
        return
    total = sum(k.ms for k in kinds.values())
    print(f"\n| {title} | steps | seconds | share of the time | mean ms | longest ms | mean batch | tokens | tok/ms "
          f"| draft ms (engine) | verify ms (engine) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, k in sorted(kinds.items(), key=lambda kv: -kv[1].ms):
        trips = {x: k.round_trips[x] / k.steps for x in ROUND_TRIPS}
        print(f"| {name} | {k.steps} | {k.ms / 1e3:.2f} | {k.ms / total:.0%} | {k.ms / k.steps:.2f} | "
              f"{k.longest_ms:.1f} | {k.batch / k.steps:.1f} | {k.committed} | {k.committed / k.ms:.2f} | "
              f"{trips['draft_ms']:.2f} ({trips['draft_engine_ms']:.2f}) | "
              f"{trips['verify_ms']:.2f} ({trips['verify_engine_ms']:.2f}) |")


def summarize(lines) -> dict[str, ChoiceSteps]:
    """'auto step' lines -> per choice: steps, probes and the sums over the other steps."""
    out: dict[str, ChoiceSteps] = defaultdict(ChoiceSteps)
    for f in _events(lines, "auto step"):
        c = out[f["choice"]]
        c.steps += 1
        if f.get("probe") == "True":
            c.probes += 1
            continue
        c.expected_ms += float(f["expected_ms"])
        c.measured_ms += float(f["measured_ms"])
        c.expected_tokens += float(f["expected_tokens"])
        c.tokens += float(f.get("tokens", "nan"))
    return dict(out)


@dataclass
class BucketChoice:
    steps: int = 0               # measured steps that are not probes
    expected_tps: float = 0.0    # sums: tokens a second expected of the step (its overhead included)
    measured_tps: float = 0.0    # tokens committed over the step's measured time (clean)
    realized: float = 0.0        # sum: the kind's delivered ratio each step's plan was scaled by (RealizedRates)
    rivals: dict = field(default_factory=dict)   # rival -> [times logged, its expected tokens a second summed]


def by_bucket(lines) -> dict[int, dict[str, BucketChoice]]:
    """'auto step' lines -> per power-of-two batch bucket and choice: what auto expected of its steps,
    what they committed a second, the ratio its kind's delivered tokens scaled its plans by, and the
    best other speculative plan it weighed (the rival) with its price: where a choice that never ran
    there lost, and at what price."""
    out: dict[int, dict[str, BucketChoice]] = defaultdict(dict)
    for f in _events(lines, "auto step"):
        if f.get("probe") == "True":
            continue
        c = out[bucket(int(f["batch"]))].setdefault(f["choice"], BucketChoice())
        c.steps += 1
        c.expected_tps += 1e3 * float(f["expected_tokens"]) / (float(f["expected_ms"]) + float(f["overhead_ms"]))
        c.measured_tps += 1e3 * float(f["tokens"]) / float(f["measured_ms"])
        c.realized += float(f.get("realized", 1.0))
        if f.get("rival") not in (None, "None"):
            r = c.rivals.setdefault(f["rival"], [0, 0.0])
            r[0] += 1
            r[1] += float(f["rival_tokens_per_second"])
    return dict(out)


def print_by_bucket(lines) -> None:
    buckets = by_bucket(lines)
    if not buckets:
        return
    print("\n| batch bucket | choice | steps | expected tok/s | clean tok/s | delivered ratio (mean) "
          "| rival (most logged) | rival expected tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    for b, choices in sorted(buckets.items()):
        for name, c in sorted(choices.items(), key=lambda kv: -kv[1].steps):
            rival, (n, tps) = max(c.rivals.items(), key=lambda kv: kv[1][0], default=("-", (1, 0.0)))
            print(f"| {b} | {name} | {c.steps} | {c.expected_tps / c.steps:.0f} | {c.measured_tps / c.steps:.0f} | "
                  f"{c.realized / c.steps:.3f} | {rival} | {tps / n:.0f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("logs", nargs="+")
    p.add_argument("--by-mode", action="store_true",
                   help="the scheduler's steps apart for each mode and run length (see by_mode)")
    p.add_argument("--by-bucket", action="store_true",
                   help="auto's choices per batch bucket, with the rival each was weighed against (see by_bucket)")
    args = p.parse_args()
    lines = []
    for path in args.logs:
        with open(path, errors="replace") as f:
            lines += f.readlines()
    rows = summarize(lines)
    print("| choice | steps | probes | expected ms | measured ms | expected tokens | committed tokens |")
    print("|---|---|---|---|---|---|---|")
    for name, c in sorted(rows.items(), key=lambda kv: -kv[1].steps):
        n = max(1, c.steps - c.probes)
        print(f"| {name} | {c.steps} | {c.probes} | {c.expected_ms / n:.2f} | {c.measured_ms / n:.2f} | "
              f"{c.expected_tokens / n:.2f} | {c.tokens / n:.2f} |")
    taken = admissions(lines)
    if taken:
        print("\n| kind | steps admitting | prompts | excess ms per prompt | charged ms per prompt (mean) |")
        print("|---|---|---|---|---|")
        for kind, a in sorted(taken.items()):
            print(f"| {kind} | {a.steps} | {a.admitted} | {a.excess_ms / max(1, a.admitted):.2f} | "
                  f"{a.charged_ms / a.steps:.2f} |")
    if args.by_bucket:
        print_by_bucket(lines)
    if args.by_mode:
        for label, block in sorted(by_mode(lines).items()):
            print_step_kinds(block, f"steps of {label}")
    else:
        print_step_kinds(lines)


if __name__ == "__main__":
    main()
