"""A head in the published layout for an 8B-shaped target (Llama-3.1-8B's widths and vocabulary,
cut to four layers so it loads in seconds), served on the GPU through the three services: greedy
output equals Hugging Face's greedy generate on the same weights, with drafts really made from
the 4096-wide hidden states and the 8,192-token draft vocabulary. Skips without CUDA."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from random_checkpoint import SHAPES, write_checkpoint  # noqa: E402
from test_eagle3_head import write_head  # noqa: E402

from benchmarks.models import write_tokenizer  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [[1, 17, 42, 99, 5], list(range(4000, 4021))]


@pytest.fixture(scope="module")
def llama8b_head(tmp_path_factory):
    root = tmp_path_factory.mktemp("llama8b")
    target, head = root / "target", root / "head"
    write_checkpoint({**SHAPES["llama-3.1-8b"], "num_hidden_layers": 4}, target, "cuda")
    write_tokenizer(target, SHAPES["llama-3.1-8b"]["vocab_size"])
    write_head(target, head, aux=(0, 1, 2), draft_vocab=8192)   # layer outputs 0, 1, 2 = inputs 1, 2, 3
    return target, head


@torch.inference_mode()
def hf_greedy_cuda(target: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    """fp32 without TF32 on the GPU: the verifier's arithmetic class, so argmax agrees."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).cuda()
    model.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        out = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(p), dtype=torch.long, device="cuda"), pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    del model
    torch.cuda.empty_cache()
    return outs


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-rows", "fp8-rows"])
def test_published_head_for_an_8b_shaped_target_serves_losslessly(llama8b_head, start_cluster, fp8):
    """fp8-rows: the hidden states packed on the verifier's GPU, unpacked into the drafter's graphs."""
    target, head = llama8b_head
    want = hf_greedy_cuda(target, PROMPTS, 16)
    cluster = start_cluster(target, target, device="cuda", dtype="float32",
                            verifier_extra=["--aux-hidden-layers", "1,2,3", "--hidden-states-fp8" if fp8 else "--no-hidden-states-fp8"],
                            drafter_extra=["--eagle3-head", str(head)])
    assert list(cluster.info("drafter").aux_hidden_layers) == [1, 2, 3]
    for prompt, expected in zip(PROMPTS, want):
        for mode, spec in (("chain", {"k": 4}), ("chain", {"k": 3, "overlap": False}),
                           ("tree", {"topk": 4, "depth": 4, "budget": 16})):
            ids, final = cluster.generate(prompt, 16, mode, timeout=300, **spec)
            assert ids == expected, (prompt, mode, spec)
            assert final.stats.mode == mode and final.stats.drafted > 0, final.stats
