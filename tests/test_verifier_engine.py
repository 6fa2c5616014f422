"""Verifier engine details: n samples share one prefill (computed once, copied to their slots)
and continue exactly as if each had been prefilled alone."""

from __future__ import annotations

import torch

from specdec.model.loader import load_model
from specdec.model.runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree
from verifier_svc.engine import VerifierEngine
from verifier_svc.types import OpenSequence, VerifierStep, VerifyItem


class CountingRunner(ModelRunner):
    def __init__(self, model) -> None:
        super().__init__(model)
        self.batch_rows: list[int] = []

    def forward(self, batch, logit_index=None):
        self.batch_rows.append(batch.tokens.shape[0])
        return super().forward(batch, logit_index)


def run(engine: VerifierEngine, opens: list[OpenSequence], steps: int) -> dict[str, list[int]]:
    out = {v.seq_id: list(v.accepted_ids) for v in engine.step(VerifierStep(0, open=opens)).verdicts}
    for i in range(steps):
        items = [VerifyItem(sid, len(engine.table.get(sid).tokens), DraftTree()) for sid in out]
        for v in engine.step(VerifierStep(i + 1, verify=items)).verdicts:
            out[v.seq_id] += v.accepted_ids
    return out


def test_shared_prefill_runs_once_and_changes_nothing(checkpoints):
    path = checkpoints["llama-gqa"]
    prompt = list(range(10, 30))
    params = [SamplingParams(1.0, seed=s) for s in (11, 12, 13)]
    shared_runner = CountingRunner(load_model(path, torch.float64, torch.device("cpu")))
    shared_engine = VerifierEngine(shared_runner, 4, 128, 8)
    shared = run(shared_engine, [
        OpenSequence("a", prompt, params[0]),
        OpenSequence("b", prompt, params[1], share_prefill_with="a"),
        OpenSequence("c", prompt, params[2], share_prefill_with="a"),
    ], steps=6)
    assert shared_runner.batch_rows[0] == 1  # one prefill row for three sequences
    assert shared_engine.prefill_tokens_computed == len(prompt)
    alone = {}
    for sid, p in zip("abc", params):
        engine = VerifierEngine(ModelRunner(load_model(path, torch.float64, torch.device("cpu"))), 1, 128, 8)
        alone.update(run(engine, [OpenSequence(sid, prompt, p)], steps=6))
    assert shared == alone
