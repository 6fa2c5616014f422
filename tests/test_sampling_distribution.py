"""Speculative sampling leaves the output distribution exactly the target's.

On a 6-token vocabulary, N sequences (each its own seed) sample their first three tokens
through the drafter and verifier engines; the empirical joint distribution of those tokens is
compared with the target-only distribution computed exactly by enumeration (HF, float64).

Test statistic (tests/distribution.py): Pearson's chi-square over the 216 outcomes, cells with
expectation < 5 merged into one. Under the null it has mean dof and standard deviation
sqrt(2 dof); we reject above dof + 6 sqrt(2 dof) (a false-alarm probability below 1e-6 by the
normal tail, and the seeds are fixed, so the test is deterministic). With N = 6000 a rule that
accepts every draft (the deliberately broken one below) lands far above that bound.
(tests/test_e2e_sampling_distribution.py runs the same check through the real services.)
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from distribution import bound, chi_square, exact_distribution
from model_factory import make_tiny_vocab_checkpoint

import verifier_svc.engine as verifier_engine
from drafter_svc.engine import DrafterEngine
from drafter_svc.types import ChainShape, DraftItem, DrafterStep, TreeShape
from specdec.model.loader import load_model
from specdec.model.runner import ModelRunner
from specdec.sampling import SamplingParams
from verifier_svc.engine import VerifierEngine
from verifier_svc.types import OpenSequence, VerifierStep, VerifyItem

N = 6000
TOKENS = 3
PROMPT = [1, 4, 2]
SAMPLING = SamplingParams(temperature=1.0, top_p=0.95)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-vocab")
    return make_tiny_vocab_checkpoint(root / "target", seed=1), make_tiny_vocab_checkpoint(root / "draft", seed=2)


def sample_through_engines(target, draft, shape, device: str = "cpu") -> Counter:
    dtype = torch.float64 if device == "cpu" else torch.float32  # on CUDA: the Triton kernels' path
    verifier = VerifierEngine(ModelRunner(load_model(target, dtype, torch.device(device))), N, 32, 16)
    drafter = DrafterEngine(ModelRunner(load_model(draft, dtype, torch.device(device))), N, 32)
    ids = [f"s{i}" for i in range(N)]
    params = [SamplingParams(SAMPLING.temperature, SAMPLING.top_p, 0, seed=1000 + i) for i in range(N)]
    res = verifier.step(VerifierStep(0, open=[OpenSequence(sid, PROMPT, p) for sid, p in zip(ids, params)]))
    out = {v.seq_id: list(v.accepted_ids) for v in res.verdicts}
    sent = dict.fromkeys(ids, 0)
    step = 0
    while any(len(o) < TOKENS for o in out.values()):
        step += 1
        live = [(sid, p) for sid, p in zip(ids, params) if len(out[sid]) < TOKENS]
        items = []
        for sid, p in live:
            full = PROMPT + out[sid]
            items.append(DraftItem(sid, len(full), full[sent[sid]:], [], shape, p))
            sent[sid] = len(full)
        drafts = drafter.step(DrafterStep(step, items))
        assert not drafts.errors
        verdicts = verifier.step(VerifierStep(step, verify=[VerifyItem(d.seq_id, d.committed_len, d.tree)
                                                               for d in drafts.drafts]))
        assert not verdicts.errors
        for v in verdicts.verdicts:
            out[v.seq_id] += v.accepted_ids
    return Counter(tuple(o[:TOKENS]) for o in out.values())


def exact(target) -> dict[tuple[int, ...], float]:
    return exact_distribution(target, PROMPT, SAMPLING, TOKENS)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [ChainShape(2), TreeShape(topk=2, depth=2, budget=4)], ids=["chain", "tree"])
def test_speculative_sampling_matches_the_target_distribution(pair, shape, device):
    target, draft = pair
    stat, dof = chi_square(sample_through_engines(target, draft, shape, device), exact(target))
    assert stat < bound(dof), f"chi2={stat:.1f} with {dof} dof"


def test_a_broken_rule_fails_the_same_test(pair, monkeypatch):
    """Accepting every draft token (ignoring the target) must be caught."""
    real = verifier_engine.spec_sample

    def accept_everything(probs, tokens, parents, depth, q_ids, q_probs, sampled, u_accept, u_bonus, *bounds):
        return real(probs, tokens, parents, depth, q_ids, q_probs, sampled, torch.zeros_like(u_accept), u_bonus,
                    *bounds)

    monkeypatch.setattr(verifier_engine, "spec_sample", accept_everything)
    target, draft = pair
    stat, dof = chi_square(sample_through_engines(target, draft, ChainShape(2)), exact(target))
    assert stat > bound(dof), f"the broken rule passed: chi2={stat:.1f} with {dof} dof"
