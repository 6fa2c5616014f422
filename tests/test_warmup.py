"""The engines' warm-ups run every kernel path they serve with (so that Triton compiles, or
fails, before SERVING) and leave no sequence, slot or counter behind."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import drafter_svc.engine as drafter_engine
import specdec.model.kv_cache as kv_cache
import specdec.model.llama as llama
import verifier_svc.engine as verifier_engine
from drafter_svc.engine import DrafterEngine
from drafter_svc.warmup import warm_up as warm_up_drafter
from specdec.model.loader import load_model
from specdec.model.runner import ModelRunner
from verifier_svc.engine import VerifierEngine
from verifier_svc.warmup import warm_up as warm_up_verifier


def count_calls(monkeypatch, calls: Counter, module, name: str, key=None) -> None:
    real = getattr(module, name)

    def counted(*args, **kwargs):
        calls[key(*args, **kwargs) if key else name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def runner(path) -> ModelRunner:
    return ModelRunner(load_model(path, torch.float32, torch.device("cpu")))


@pytest.mark.parametrize("slots, max_draft_tokens", [(4, 16), (1, 1)])
def test_verifier_warm_up_runs_every_path(checkpoints, monkeypatch, slots, max_draft_tokens):
    calls: Counter = Counter()
    count_calls(monkeypatch, calls, verifier_engine, "greedy_accept")
    count_calls(monkeypatch, calls, verifier_engine, "spec_sample",
                key=lambda *a: "spec_sample sampled" if bool(a[6].any()) else "spec_sample point masses")
    count_calls(monkeypatch, calls, kv_cache, "compact")
    count_calls(monkeypatch, calls, llama, "tree_attention")
    engine = VerifierEngine(runner(checkpoints["llama-gqa"]), slots, 64, max_draft_tokens)
    count_calls(monkeypatch, calls, engine.runner, "copy_prefix")
    warm_up_verifier(engine)
    expected = {"greedy_accept", "spec_sample sampled", "spec_sample point masses", "compact", "tree_attention"}
    assert expected <= set(calls), calls
    assert ("copy_prefix" in calls) == (slots > 1)  # a shared prefill needs two slots
    assert len(engine.table) == 0 and engine.table.opened == 0 and engine.prefill_tokens_computed == 0
    assert len(engine.table._free_slots) == slots


def test_drafter_warm_up_runs_every_path(checkpoints, monkeypatch):
    calls: Counter = Counter()
    engine = DrafterEngine(runner(checkpoints["llama-gqa/draft"]), 1, 64)
    count_calls(monkeypatch, calls, drafter_engine, "expand_trees")  # deterministic top-k, sampled or not
    count_calls(monkeypatch, calls, engine, "_draft_chains",
                key=lambda states, ks, params, logits: f"chain {params[0].greedy}")
    count_calls(monkeypatch, calls, llama, "tree_attention")
    warm_up_drafter(engine)
    assert {"expand_trees", "chain True", "chain False", "tree_attention"} <= set(calls), calls
    assert len(engine.table) == 0 and engine.table.opened == 0
