"""What one run of one cell measured (`RunResult`), computed the same way for every path from
per-sequence traces, and the analytic speedup it is compared against."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field


@dataclass
class SeqTrace:
    """One sequence (a request through the gateway): when its tokens arrived, and its counters."""

    start: float
    tokens: list[int] = field(default_factory=list)
    first: float | None = None      # arrival of the first output token
    last: float | None = None       # arrival of the last one
    steps: int = 0                  # verify steps after the prefill
    drafted: int = 0
    accepted: int = 0
    committed: int = 0              # tokens committed by those steps, bonus included
    overlap_hits: int = 0
    overlap_misses: int = 0
    min_step_accepted: int | None = None  # in-process only: the fewest drafts a step accepted
    depth_sum: int = 0              # in-process only: deepest draft node of each drafted step, summed
    drafted_steps: int = 0

    def arrived(self, t: float, ids: list[int]) -> None:
        if ids:
            self.first = t if self.first is None else self.first
            self.last = t
            self.tokens += ids


@dataclass
class RunResult:
    path: str                      # "in-process" | "gateway" | "hf"
    pair: str
    config: str
    concurrency: int
    acceptance: float | None       # None: mode off, or real acceptance
    tok_s: float
    tpot_p50_ms: float
    tpot_p99_ms: float
    ttft_p50_ms: float
    step_ms: float | None          # wall time per verify step after the first token (median sequence)
    steps: int
    drafted: int
    accepted: int
    accept_len: float              # tokens committed per verify step, bonus included
    overlap_hit: float | None
    min_step_accepted: int | None = None
    draft_depth: float | None = None  # in-process: mean depth of a step's draft (a chain's k)
    draft_ms: float | None = None  # mean drafter call made before a verify step (gateway: per gateway step)
    verify_ms: float | None = None  # mean verifier call (gateway: its engine time per gateway step)
    predraft_ms: float | None = None           # gateway: overlap's pre-draft round trip per step
    predraft_exposed_ms: float | None = None   # gateway: what a step waited for it after the verdict
    overlap_hidden: float | None = None        # gateway: share of drafter time off the step's path
    loop_step_ms: float | None = None          # gateway: one step of its loop (the batch's, not a sequence's)
    draft_engine_ms: float | None = None       # gateway: the synchronous drafts' engine time per step
    transport_ms: float | None = None          # gateway: round trips less engine time per step
    gateway_ms: float | None = None            # gateway: the step less what it waited for the services
    speedup: float | None = None   # tok/s over mode off at the same path, pair and concurrency
    same_as_off: float | None = None  # share of sequences with exactly mode off's tokens
    wave_tok_s: list[float] = field(default_factory=list)   # gateway: each measured wave's tok/s, in the order run
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("outputs")
        return d


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))]


def summarize(traces: list[SeqTrace], path: str, pair: str, config: str, concurrency: int,
              acceptance: float | None, **extra) -> RunResult:
    """tok/s over the whole wave; TPOT per sequence (last - first token) / (tokens - 1), p50/p99
    over sequences (one sequence at C = 1); step time (last - first) / steps, median sequence."""
    wall = max(t.last for t in traces) - min(t.start for t in traces)
    tpot = [(t.last - t.first) / max(1, len(t.tokens) - 1) for t in traces]
    step = [(t.last - t.first) / t.steps for t in traces if t.steps]
    steps = sum(t.steps for t in traces)
    hits, misses = sum(t.overlap_hits for t in traces), sum(t.overlap_misses for t in traces)
    mins = [t.min_step_accepted for t in traces if t.min_step_accepted is not None]
    return RunResult(
        path=path, pair=pair, config=config, concurrency=concurrency, acceptance=acceptance,
        tok_s=sum(len(t.tokens) for t in traces) / wall,
        tpot_p50_ms=1e3 * statistics.median(tpot), tpot_p99_ms=1e3 * percentile(tpot, 99),
        ttft_p50_ms=1e3 * statistics.median(t.first - t.start for t in traces),
        step_ms=1e3 * statistics.median(step) if step else None,
        steps=steps, drafted=sum(t.drafted for t in traces), accepted=sum(t.accepted for t in traces),
        accept_len=sum(t.committed for t in traces) / steps if steps else 1.0,
        overlap_hit=hits / (hits + misses) if hits + misses else None,
        min_step_accepted=min(mins) if mins else None,
        draft_depth=(sum(t.depth_sum for t in traces) / sum(t.drafted_steps for t in traces)
                     if any(t.drafted_steps for t in traces) else None),
        outputs=[t.tokens for t in traces], **extra,
    )


def expected_accept_len(a: float, depth: float) -> float:
    """Tokens per step, bonus included, when each of `depth` path positions is kept with
    probability a: (1 - a^(depth+1)) / (1 - a)."""
    return depth + 1 if a >= 1 else (1 - a ** (depth + 1)) / (1 - a)


def ideal_speedup(a: float, k: int, c: float) -> float:
    """Chain speculation without overlap: (1 - a^(k+1)) / ((1 - a)(1 + k c)), c = draft token
    cost / target step cost (the expected tokens per step over the step's relative cost)."""
    return expected_accept_len(a, k) / (1 + k * c)


def attach_baselines(results: list[RunResult]) -> None:
    """Speedup and same-tokens-as-off of every row against mode off at its path, pair and C."""
    off = {(r.path, r.pair, r.concurrency): r for r in results if r.config == "off"}
    for r in results:
        base = off.get((r.path, r.pair, r.concurrency))
        if base is None or r is base:
            continue
        r.speedup = r.tok_s / base.tok_s
        if base.outputs and r.outputs:
            pairs = list(zip(r.outputs, base.outputs))
            r.same_as_off = sum(a == b for a, b in pairs) / len(pairs)
