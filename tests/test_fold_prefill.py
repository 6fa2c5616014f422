"""Prompt chunks folded into the verify forward (`fold_prefill`): a step's prompt chunks ride in its
verify forward as rows as wide as its draft trees, each after the KV its earlier rows write in the
same forward. What comes out must be what a forward of their own gives: the same first tokens, the
same verdicts for the running sequences (chains and trees), the same EAGLE-3 hidden states of the
prompts, the same KV for a shared prompt's followers, with whole prompts and in chunks. And the
folded steps must really run one forward."""

from __future__ import annotations

import random

import pytest
import torch

from specdec.model.loader import load_model
from specdec.model.runner import ModelRunner
from specdec.tree import DraftTree
from verifier_svc.engine import VerifierEngine
from verifier_svc.types import OpenSequence, VerifierStep, VerifyItem

AUX = (0, 2)


class CountingRunner(ModelRunner):
    def __init__(self, model) -> None:
        super().__init__(model)
        self.forwards = 0
        self.rows = 0   # the most rows a forward had

    def forward_with_aux(self, batch, logit_index=None):
        self.forwards += 1
        self.rows = max(self.rows, batch.tokens.shape[0])
        return super().forward_with_aux(batch, logit_index)


def engine(path, chunk: int, fold: bool, device: str = "cpu", dtype=torch.float64, graphs: bool = False):
    runner = CountingRunner(load_model(path, dtype, torch.device(device)))
    eng = VerifierEngine(runner, 6, 128, 8, aux_layers=AUX, prefill_chunk=chunk, fold_prefill=fold)
    if graphs:   # as the service captures them: for every row a folded forward may have
        runner.capture_cuda_graphs(eng.graph_rows, (1, 2, 3, 5, 9))
    return eng


def draft(rng: random.Random, tree: bool) -> DraftTree:
    """A random chain of 4 or tree of 6 (mostly rejected: the verdicts still differ per position)."""
    if tree:
        return DraftTree([rng.randrange(380) for _ in range(6)], [0, 0, 1, 1, 2, 3])
    return DraftTree([rng.randrange(380) for _ in range(4)], [0, 1, 2, 3])


def scenario(eng: VerifierEngine, seed: int, off: bool = False) -> list[tuple]:
    """Two sequences running; prompts (one of them twice, shared) arrive at steps 1 and 4, each
    then verified like the others once answered (off: without drafts, as mode off verifies).
    -> every verdict and error, in order."""
    rng = random.Random(seed)
    shared = [(3 * i + 1) % 380 for i in range(23)]
    arrivals = {1: [("p1", shared, ""), ("p2", shared, "p1")],
                4: [("p3", [(11 * i + 5) % 380 for i in range(9)], ""), ("p4", [42], "")]}
    out = []
    res = eng.step(VerifierStep(0, open=[OpenSequence("r1", [1, 2, 3, 4, 5], want_hidden=True),
                                         OpenSequence("r2", [9, 8, 7], want_hidden=True)]))
    answered = {v.seq_id for v in res.verdicts}
    for step in range(1, 12):
        opens = [OpenSequence(sid, p, share_prefill_with=share, want_hidden=True)
                 for sid, p, share in arrivals.get(step, [])]
        verify = [VerifyItem(sid, len(eng.table.get(sid).tokens),
                             DraftTree() if off else draft(rng, tree=(sid in ("r2", "p3"))))
                  for sid in sorted(answered)]
        res = eng.step(VerifierStep(step, open=opens, verify=verify))
        assert not res.errors, res.errors
        for v in res.verdicts:
            answered.add(v.seq_id)
            out.append((step, v.seq_id, v.committed_len, tuple(v.accepted_ids), v.accepted_drafts,
                        None if v.hidden is None else v.hidden.clone()))
    return out


def check_same(want: list[tuple], got: list[tuple], tol: float) -> None:
    assert [w[:5] for w in want] == [g[:5] for g in got]
    for w, g in zip(want, got):
        assert (w[5] is None) == (g[5] is None), w[:2]
        if w[5] is not None:
            torch.testing.assert_close(g[5], w[5], rtol=tol, atol=tol, msg=f"hidden states of {w[1]} at {w[0]}")


@pytest.mark.parametrize("chunk", [0, 8])
def test_folded_prompts_give_what_a_prefill_forward_gives(checkpoints, chunk):
    path = checkpoints["llama-gqa"]
    apart, folded = engine(path, chunk, fold=False), engine(path, chunk, fold=True)
    check_same(scenario(apart, 3), scenario(folded, 3), 1e-9)
    # The prompts rode in the verify forwards: fewer forwards in all (and never more)
    assert folded.runner.forwards < apart.runner.forwards
    assert folded.prefill_tokens_computed == apart.prefill_tokens_computed


def test_prompts_too_many_for_the_rows_get_a_forward_of_their_own(checkpoints):
    """graph_rows (2 x max_sequences) bounds a folded forward: a prompt that would need more rows
    runs apart, and still answers the same."""
    path = checkpoints["llama-gqa"]
    results = []
    for fold in (False, True):
        eng = engine(path, 0, fold)
        eng.step(VerifierStep(0, open=[OpenSequence("r", [1, 2, 3])]))
        long = [(5 * i) % 380 for i in range(60)]    # 60 tokens at width 1: 60 rows > 12
        before = eng.runner.forwards
        res = eng.step(VerifierStep(1, open=[OpenSequence("p", long)], verify=[VerifyItem("r", 4, DraftTree())]))
        results.append(([(v.seq_id, tuple(v.accepted_ids)) for v in res.verdicts], eng.runner.forwards - before))
    assert results[0] == results[1] and results[1][1] == 2


def test_mode_offs_prompts_fold_into_a_widened_verify_where_the_pass_saved_pays_for_the_padding(checkpoints):
    """Mode off verifies a row of one token a sequence, so its prompts never fit the rows at that width
    (23 tokens: 25 rows > 12): the verify forward widens to the narrowest captured width that fits (3:
    10 rows of 3) when that padding costs less than the forward it saves (fold_pass_tokens, the
    weights' pass in tokens), and answers what prefilling apart answers."""
    path = checkpoints["llama-gqa"]
    apart = engine(path, 0, fold=False)
    want = scenario(apart, 3, off=True)
    forwards = {}
    for pass_tokens in (0.0, 1.0, 1000.0):
        folded = engine(path, 0, fold=True)
        folded.fold_pass_tokens = pass_tokens
        check_same(want, scenario(folded, 3, off=True), 1e-9)
        forwards[pass_tokens] = folded.runner.forwards
        assert folded.runner.rows <= folded.graph_rows   # the rows its graphs were captured for
    # Unpriced: never widened. A pass worth one token: step 1's prompt stays apart (25 tokens apart + 1
    # against 10 rows of 3 folded), step 4's two fold (4 rows + 9 + 1 tokens apart, 22 + 1, against 10 rows
    # of 2). Priced dear: both arrivals fold.
    assert forwards[0.0] == apart.runner.forwards
    assert forwards[1.0] == apart.runner.forwards - 1 and forwards[1000.0] == apart.runner.forwards - 2


def test_a_forwards_pass_over_the_weights_in_tokens_from_the_cost_profile():
    from specdec.cost_profile import StepCost
    from verifier_svc.cost_profile import pass_tokens

    ms = {(1, 1): 8.0, (1, 17): 8.5, (64, 1): 9.0, (64, 5): 13.0, (64, 17): 25.0}
    costs = [StepCost(f"verify:{w}", b, t / 1e3) for (b, w), t in ms.items()] + [StepCost("chain:4", 64, 1.0)]
    # 16 ms over 64 x 16 tokens at batch 64: 1/64 ms a token; the one-token step 8 ms
    assert pass_tokens(costs) == pytest.approx(512.0)
    assert pass_tokens(costs[2:]) == 0.0   # no one-token step to price the pass
    flat = [StepCost("verify:1", 1, 0.008), StepCost("verify:1", 64, 0.009), StepCost("verify:17", 64, 0.009)]
    assert pass_tokens(flat) == 0.0        # tokens cost nothing measurable: no price


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_folded_prompts_replayed_as_cuda_graphs(checkpoints):
    """On the GPU, the folded forwards replayed from graphs captured for graph_rows rows (fp32, so
    argmax ties are far) against the eager engine that prefills apart."""
    path = checkpoints["llama-gqa"]
    apart = engine(path, 8, fold=False, device="cuda", dtype=torch.float32)
    folded = engine(path, 8, fold=True, device="cuda", dtype=torch.float32, graphs=True)
    check_same(scenario(apart, 5), scenario(folded, 5), 1e-4)
    assert folded.runner.forwards < apart.runner.forwards


def test_folded_prompts_through_the_graph_padding(checkpoints, monkeypatch):
    """On the CPU, the folded steps through the graph machinery (batch and query padding, static
    inputs; replay replaced by an eager forward over them, as tests/test_cuda_graphs.py does)."""
    from test_cuda_graphs import EagerGraphs, count_replays

    monkeypatch.setattr("specdec.model.runner.GraphedForward", EagerGraphs)
    path = checkpoints["llama-gqa"]
    apart, folded = engine(path, 8, fold=False), engine(path, 8, fold=True, graphs=True)
    replayed = count_replays(folded.runner.graphs)
    check_same(scenario(apart, 5), scenario(folded, 5), 1e-9)
    assert folded.runner.forwards < apart.runner.forwards
    assert sum(r is not None for r in replayed) == folded.runner.forwards - 1   # all but step 0's prefill
