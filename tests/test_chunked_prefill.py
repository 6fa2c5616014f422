"""Chunked prefill in the verifier engine: long prompts arriving while a sequence is running enter
the KV cache at most `chunk` tokens per step over all of them, the running sequence is verified in
every one of those steps, and what comes out is exactly what whole-prompt prefill gives: the first
tokens, the greedy continuations (= Hugging Face's), the EAGLE-3 hidden states of the prompt, and
the KV a shared prompt's followers copy, also when the leader is closed mid-prefill.

(The services the tests start prefill in chunks of 6 tokens (conftest), so every end-to-end test
with a longer prompt runs this path through gRPC as well.)"""

from __future__ import annotations

import pytest
import torch
from model_factory import hf_greedy

from specdec.model.loader import load_model
from specdec.model.runner import ModelRunner
from specdec.tree import DraftTree
from verifier_svc.engine import VerifierEngine
from verifier_svc.types import OpenSequence, VerifierStep, VerifyItem

CHUNK = 8
AUX = (0, 2)


def engine(path, chunk: int) -> VerifierEngine:
    return VerifierEngine(ModelRunner(load_model(path, torch.float64, torch.device("cpu"))), 6, 128, 8,
                          aux_layers=AUX, prefill_chunk=chunk)


def prompts() -> dict[str, list[int]]:
    return {"long": [(7 * i + 3) % 380 for i in range(45)], "twin": [(7 * i + 3) % 380 for i in range(45)],
            "mid": [(5 * i + 1) % 380 for i in range(20)], "tiny": [9, 8, 7]}


def run(eng: VerifierEngine, opens: list[OpenSequence], steps: int, running: list[int] | None = None):
    """Step `eng`, verifying "running" (greedy, empty drafts) each step; -> (verdicts by id, steps
    each id waited, per-step prefill tokens, tokens of "running")."""
    firsts, waited, per_step = {}, {}, []
    step = VerifierStep(1, open=opens)
    for i in range(steps):
        if running is not None:
            step.verify = [VerifyItem("running", len(running), DraftTree([], []))]
        before = eng.prefill_tokens_computed
        res = eng.step(step)
        assert not res.errors, res.errors
        per_step.append(eng.prefill_tokens_computed - before)
        for v in res.verdicts:
            if v.seq_id == "running":
                running += v.accepted_ids
            else:
                firsts[v.seq_id], waited[v.seq_id] = v, i
        if running is not None:
            assert any(v.seq_id == "running" for v in res.verdicts), f"step {i} did not verify the running sequence"
        step = VerifierStep(i + 2)
    return firsts, waited, per_step, running


def test_long_prompts_trickle_in_while_the_running_sequence_advances(checkpoints):
    path = checkpoints["llama-gqa"]
    whole, chunked = engine(path, 0), engine(path, CHUNK)
    p = prompts()
    opens = lambda: [OpenSequence(s, list(t), share_prefill_with="long" if s == "twin" else "", want_hidden=True)  # noqa: E731
                     for s, t in p.items()]
    ref, _, ref_steps, _ = run(whole, opens(), 1)
    assert ref_steps == [45 + 20 + 3] and set(ref) == set(p)        # whole prompts: one step, twin shares

    running = [4, 4, 2]
    first = chunked.step(VerifierStep(0, open=[OpenSequence("running", running)])).verdicts[0]
    running += first.accepted_ids
    got, waited, per_step, running = run(chunked, opens(), 10, running)
    assert max(per_step) == CHUNK and sum(per_step) == 45 + 20 + 3   # at most one chunk per step, twin rides along
    assert waited["long"] == waited["twin"] == 45 // CHUNK and waited["tiny"] >= waited["mid"] > waited["long"]
    for sid in p:
        assert got[sid].accepted_ids == ref[sid].accepted_ids, sid
        torch.testing.assert_close(got[sid].hidden, ref[sid].hidden)   # [prompt, A]: the whole prompt's rows
    assert running[3:] == hf_greedy(path, [4, 4, 2], len(running) - 3)
    for sid, toks in p.items():   # and the chunked KV is right: greedy continuations equal HF's
        seq = toks + got[sid].accepted_ids
        for i in range(6):
            v = chunked.step(VerifierStep(20 + i, verify=[VerifyItem(sid, len(seq), DraftTree([], []))])).verdicts[0]
            seq += v.accepted_ids
        assert seq[len(toks):] == hf_greedy(path, toks, 7), sid


@pytest.mark.parametrize("close", ["long", "twin"])
def test_closing_a_shared_prompt_mid_prefill_leaves_the_other_exact(checkpoints, close):
    path = checkpoints["llama-gqa"]
    eng = engine(path, CHUNK)
    p = prompts()
    eng.step(VerifierStep(0, open=[OpenSequence("long", p["long"]),
                                   OpenSequence("twin", p["twin"], share_prefill_with="long")]))
    keep = "twin" if close == "long" else "long"
    res = eng.step(VerifierStep(1, close=[close]))
    for i in range(12):
        if res.verdicts:
            break
        res = eng.step(VerifierStep(2 + i))
    assert [v.seq_id for v in res.verdicts] == [keep]
    assert res.verdicts[0].accepted_ids == hf_greedy(path, p[keep], 1)
    assert eng.step(VerifierStep(30, verify=[VerifyItem(close, 45, DraftTree([], []))])).errors  # gone
    assert len(eng.table) == 1 and close not in eng.prefills


def test_a_prefilling_sequence_cannot_be_verified(checkpoints):
    eng = engine(checkpoints["llama-gqa"], CHUNK)
    eng.step(VerifierStep(0, open=[OpenSequence("long", prompts()["long"])]))
    err = eng.step(VerifierStep(1, verify=[VerifyItem("long", 45, DraftTree([], []))])).errors
    assert err and "still prefilling" in err[0].message
