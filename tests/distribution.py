"""Exact output distributions of a small-vocabulary model, and the chi-square test against them.

Over a tiny vocabulary every continuation of T tokens can be enumerated (V**T outcomes): the
probability of each is the product of the model's processed next-token probabilities (float64,
Hugging Face's own temperature / top-k / top-p warpers, cross-checked against
specdec.sampling.processed_probs). `chain_distribution` gives the same for chain speculative
sampling under the standard rule or a deliberately broken one; `expected_statistic` then says
how far above the bound a broken rule lands with N samples, i.e. the test's power.

Test statistic: Pearson's chi-square over the outcomes, cells with expectation < 5 merged into
one. Under the null it has mean dof and standard deviation sqrt(2 dof); `bound` rejects above
dof + 6 sqrt(2 dof) (a false-alarm probability below 1e-6 by the normal tail; the seeds are
fixed, so each test is deterministic).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specdec.sampling import SamplingParams, processed_probs

Outcome = tuple[int, ...]


@functools.lru_cache(maxsize=8)
def _model(checkpoint: str):
    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float64).eval()


def _hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [R, V] -> probabilities [R, V] with transformers' warpers (the external reference)."""
    warpers = LogitsProcessorList()
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if 0 < params.top_k < logits.shape[-1]:
        warpers.append(TopKLogitsWarper(params.top_k))
    if 0 < params.top_p < 1:
        warpers.append(TopPLogitsWarper(params.top_p))
    return torch.softmax(warpers(None, logits), dim=-1)


@functools.lru_cache(maxsize=32)
def next_token_probs(checkpoint: Path, prompt: tuple[int, ...], params: SamplingParams, tokens: int
                     ) -> tuple[list[Outcome], torch.Tensor]:
    """All V**tokens continuations of `prompt`, and [O, tokens, V]: the processed next-token
    distribution before each of their tokens (sampling: temperature > 0)."""
    assert not params.greedy
    model = _model(str(checkpoint))
    vocab = model.config.vocab_size
    outcomes = list(itertools.product(range(vocab), repeat=tokens))
    seqs = torch.tensor([list(prompt) + list(o) for o in outcomes])
    with torch.no_grad():
        logits = model(seqs).logits[:, len(prompt) - 1 : -1]                       # [O, T, V]
    probs = _hf_probs(logits.reshape(-1, vocab), params).reshape(logits.shape)
    ours = processed_probs(logits, [params] * len(outcomes))
    gap = float((probs - ours).abs().max())
    assert gap < 1e-9, f"HF warpers and specdec.sampling disagree by {gap} (a top-p tie, or a sampling bug)"
    return outcomes, probs


def exact_distribution(checkpoint: Path, prompt: Sequence[int], params: SamplingParams, tokens: int
                       ) -> dict[Outcome, float]:
    """P(first `tokens` generated tokens) when sampling from the model alone."""
    outcomes, probs = next_token_probs(Path(checkpoint), tuple(prompt), params, tokens)
    picked = probs.gather(-1, torch.tensor(outcomes)[..., None])[..., 0]
    return dict(zip(outcomes, picked.prod(-1).tolist()))


def hf_greedy_many(checkpoint: Path, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """model_factory.hf_greedy (transformers generate(do_sample=False), float64, EOS ignored) for
    several prompts of one length in one batch, on the cached model."""
    assert len({len(p) for p in prompts}) == 1, "prompts of one length (no padding)"
    model = _model(str(checkpoint))
    model.generation_config.eos_token_id = None
    ids = torch.tensor([list(p) for p in prompts])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False, attention_mask=torch.ones_like(ids),
                         pad_token_id=0)
    return out[:, ids.shape[1]:].tolist()


RULES = ("exact", "resample_from_target", "accept_all")


def chain_distribution(target: Path, draft: Path, prompt: Sequence[int], params: SamplingParams, k: int,
                       tokens: int, rule: str) -> dict[Outcome, float]:
    """P(first `tokens` tokens) of chain speculative sampling, k drafts per step, under `rule`:
    "exact" (the standard rule; equals exact_distribution), or a broken one for power analysis:
    "resample_from_target" (after a rejection draw from p, not from normalize(max(0, p - q))) or
    "accept_all" (every draft accepted). The first token comes from the prefill (p); each step
    drafts k tokens from q and ends at the first rejection or with the bonus token from p."""
    assert rule in RULES
    outcomes, p = next_token_probs(Path(target), tuple(prompt), params, tokens)
    _, q = next_token_probs(Path(draft), tuple(prompt), params, tokens)
    idx = torch.tensor(outcomes)[..., None]                                        # [O, T, 1]
    p_x, q_x = p.gather(-1, idx)[..., 0], q.gather(-1, idx)[..., 0]                # [O, T]
    both = torch.minimum(p, q)
    both_x, beta = both.gather(-1, idx)[..., 0], both.sum(-1)
    state = torch.zeros(len(outcomes), k + 1, dtype=torch.float64)  # by drafts accepted so far this step
    state[:, 0] = p_x[:, 0]
    for i in range(1, tokens):
        if rule == "accept_all":
            accept, reject = q_x[:, i], torch.zeros_like(q_x[:, i])
        elif rule == "exact":
            accept, reject = both_x[:, i], p_x[:, i] - both_x[:, i]
        else:
            accept, reject = both_x[:, i], (1 - beta[:, i]) * p_x[:, i]
        nxt = torch.zeros_like(state)
        nxt[:, 1:] = state[:, :-1] * accept[:, None]
        nxt[:, 0] = (state[:, :-1] * reject[:, None]).sum(-1) + state[:, -1] * p_x[:, i]  # rejection, bonus
        state = nxt
    return dict(zip(outcomes, state.sum(-1).tolist()))


def marginal(dist: dict[Outcome, float], positions: Sequence[int]) -> dict[Outcome, float]:
    out: dict[Outcome, float] = {}
    for outcome, p in dist.items():
        key = tuple(outcome[i] for i in positions)
        out[key] = out.get(key, 0.0) + p
    return out


def counts_at(samples: Iterable[Sequence[int]], positions: Sequence[int]) -> Counter:
    return Counter(tuple(s[i] for i in positions) for s in samples)


def _cells(exact: dict[Outcome, float], n: int) -> list[tuple[list[Outcome], float]]:
    """Outcomes grouped into cells: one per outcome expected >= 5 times, the rest merged."""
    cells, rest, rest_p = [], [], 0.0
    for outcome, p in exact.items():
        if p * n < 5:
            rest.append(outcome)
            rest_p += p
        else:
            cells.append(([outcome], p))
    if rest_p > 0:
        cells.append((rest, rest_p))
    return cells


def chi_square(counts: Counter, exact: dict[Outcome, float], n: int | None = None) -> tuple[float, int]:
    """Pearson's statistic of `counts` (N = their total unless given) against `exact`: (stat, dof)."""
    n = sum(counts.values()) if n is None else n
    cells = _cells(exact, n)
    stat = sum((sum(counts.get(x, 0) for x in outcomes) - n * p) ** 2 / (n * p) for outcomes, p in cells)
    return stat, len(cells) - 1


def bound(dof: int) -> float:
    return dof + 6 * math.sqrt(2 * dof)


def expected_statistic(exact: dict[Outcome, float], alt: dict[Outcome, float], n: int) -> float:
    """E[chi_square] of N samples drawn from `alt` instead of `exact` (over the same cells)."""
    total = 0.0
    for outcomes, p in _cells(exact, n):
        a = sum(alt.get(x, 0.0) for x in outcomes)
        total += (a * (1 - a) + n * (a - p) ** 2) / p
    return total


def impossible(counts: Counter, exact: dict[Outcome, float]) -> list[Outcome]:
    """Observed outcomes of probability 0 (cut by top-k / top-p)."""
    return [o for o in counts if exact.get(o, 0.0) <= 0.0]


def assert_matches(counts: Counter, exact: dict[Outcome, float], what: str = "") -> tuple[float, int]:
    """No impossible outcome, and the chi-square statistic below the bound; -> (stat, dof)."""
    bad = impossible(counts, exact)
    assert not bad, f"{what}: outcomes of probability 0 were sampled: {bad[:5]}"
    stat, dof = chi_square(counts, exact)
    summary = f"{what}: chi2={stat:.1f} with {dof} dof (bound {bound(dof):.1f}), N={sum(counts.values())}"
    print(summary)
    assert stat < bound(dof), summary
    return stat, dof
