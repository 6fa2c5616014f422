"""Judging half-precision outputs against a float32 reference: where a half-precision greedy
decode may legitimately differ from another one (a near-tie of the fp32 logits, i.e. numerics)
and where it may not (a logic bug). Used by tests/half_precision_cluster.py; pure torch, no CUDA.

The rule: a greedy decoder computing in bf16 emits, after a prefix, a token whose exact (fp32)
logit is within the bf16 noise of the fp32 maximum. Two such decoders (two modes of the server)
can differ at their first divergence only between two tokens that are both that close to the
maximum: a near-tie. A token further below the maximum than the noise is a logic error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch


@torch.no_grad()
def teacher_forced_logits(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """[len(ids), V] float64: row i is the model's logits after prompt + ids[:i] (one forward)."""
    device = next(model.parameters()).device
    seq = torch.tensor([prompt + ids[:-1]], device=device)
    logits = model(seq, attention_mask=torch.ones_like(seq)).logits[0].double().cpu()
    return logits[len(prompt) - 1:]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where a and b differ (a shorter one differs where it ends), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def gaps(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """[len(ids)] how far each emitted token's logit is below its row's maximum (0 = argmax)."""
    rows = logits[: len(ids)]
    return rows.max(-1).values - rows.gather(1, torch.tensor(ids)[:, None])[:, 0]


@dataclass
class Judged:
    """One comparison of two decodes of the same prompt (`got` against `ref`)."""

    model: str
    prompt: int
    mode: str                       # what `got` is, e.g. "chain k=4", "off vs hf-fp32"
    index: int | None = None        # first divergence (index into the generated tokens), None = identical
    ref_token: int | None = None
    got_token: int | None = None
    pair_margin: float | None = None  # |fp32 logit(ref_token) - fp32 logit(got_token)|
    worst_gap: float | None = None    # max over the two of (fp32 max - fp32 logit(token))
    ranks: tuple[int, int] | None = None  # fp32 ranks of (ref_token, got_token), 1 = argmax
    top2_margin: float | None = None
    tau: float = 0.0
    ok: bool = True
    note: str = ""


def judge_divergence(model: str, prompt: int, mode: str, ref: list[int], got: list[int],
                     logits: torch.Tensor, tau: torch.Tensor) -> Judged:
    """`logits`: fp32-reference teacher-forced logits along `ref` (rows valid up to the
    divergence, where the two prefixes are still equal); `tau`: the allowed gap per row. A
    divergence passes when both tokens' fp32 logits are within tau of the fp32 maximum there: a
    near-tie (a two-way tie makes them the fp32 top-2 with top-2 margin <= tau; in a three-way
    tie either may be third)."""
    j = Judged(model, prompt, mode, tau=float("nan"))
    i = first_divergence(ref, got)
    if i is None:
        return j
    j.index = i
    j.tau = float(tau[min(i, len(tau) - 1)])
    if i >= min(len(ref), len(got)):
        j.ok, j.note = False, f"lengths differ: {len(ref)} vs {len(got)}"
        return j
    row = logits[i]
    j.ref_token, j.got_token = ref[i], got[i]
    top = row.max()
    gap_ref, gap_got = float(top - row[ref[i]]), float(top - row[got[i]])
    j.pair_margin = abs(float(row[ref[i]] - row[got[i]]))
    j.worst_gap = max(gap_ref, gap_got)
    order = row.argsort(descending=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(1, len(row) + 1)
    j.ranks = (int(rank[ref[i]]), int(rank[got[i]]))
    top2 = row.topk(2).values
    j.top2_margin = float(top2[0] - top2[1])
    j.ok = j.worst_gap <= j.tau
    if not j.ok:
        j.note = "NOT a near-tie: a logic error, not rounding"
    return j


def _fmt(x, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[Judged]) -> str:
    head = (f"{'model':<18} {'prompt':>6} {'mode':<40} {'first div':>9} {'tokens ref/got':>15} "
            f"{'fp32 margin':>11} {'worst gap':>9} {'ranks':>7} {'top2 margin':>11} {'tau':>8}  verdict")
    lines = [head, "-" * len(head)]
    for r in rows:
        toks = "-" if r.ref_token is None else f"{r.ref_token}/{r.got_token}"
        ranks = "-" if r.ranks is None else f"{r.ranks[0]}/{r.ranks[1]}"
        verdict = "same" if r.index is None else ("near-tie" if r.ok else "FAIL")
        lines.append(f"{r.model:<18} {r.prompt:>6} {r.mode:<40} {_fmt(r.index, 'd'):>9} {toks:>15} "
                     f"{_fmt(r.pair_margin):>11} {_fmt(r.worst_gap):>9} {ranks:>7} {_fmt(r.top2_margin):>11} "
                     f"{_fmt(None if r.index is None else r.tau):>8}  {verdict} {r.note}".rstrip())
    return "\n".join(lines)


def publish(name: str, text: str) -> None:
    """print() (shown by pytest -s / -rA) and, when SPECDEC_REPORT_DIR is set, a file there."""
    print(f"\n===== {name} =====\n{text}")
    out = os.environ.get("SPECDEC_REPORT_DIR")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.txt").write_text(text + "\n")
