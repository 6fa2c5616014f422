"""Real CUDA graphs on the GPU: replayed verify steps give the verdicts, logits and KV of the
eager forward on the same inputs (fp32, so argmax ties are far), padding included, and so do
replayed prompt chunks (last-logit graphs); a graphed
drafter (catch-up replays, whole chains as one replay) drafts what the eager one drafts. The CUDA
end-to-end tests (test_e2e_cuda.py, test_e2e_bf16_cuda.py) serve with graphs on, the default.
Skips without CUDA."""

from __future__ import annotations

import pytest
import torch
from test_draft_graphs import check_drafts, drafter
from test_cuda_graphs import check_logits, check_padded_prefill, check_padded_steps, check_wide_trees, engines, \
    wide_engines

from specdec.model.cuda_graphs import GraphedForward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_replayed_steps_equal_eager_steps(checkpoints):
    check_padded_steps(*engines(checkpoints["llama-gqa"], "cuda", torch.float32, GraphedForward), tol=1e-5)


def test_replayed_wide_trees_equal_eager_ones(checkpoints):
    check_wide_trees(*wide_engines(checkpoints["llama-gqa"], "cuda", torch.float32, GraphedForward), tol=1e-5)


def test_replayed_prefills_equal_eager_prefills(checkpoints):
    check_padded_prefill(checkpoints["llama-gqa"], "cuda", torch.float32, GraphedForward, tol=1e-5)


def test_replayed_logits_equal_eager_logits(checkpoints):
    check_logits(*engines(checkpoints["qwen2-bias"], "cuda", torch.float32, GraphedForward), tol=1e-4)


def test_graphed_drafter_equals_eager_drafter(checkpoints):
    path = checkpoints["llama-gqa"]
    check_drafts(drafter(path, False, "cuda", torch.float32), drafter(path, True, "cuda", torch.float32), tol=1e-4)


@pytest.mark.parametrize("projected", [False, True], ids=["rows", "projected-rows"])
def test_graphed_eagle3_drafter_equals_eager_drafter(checkpoints, tmp_path, projected):
    from test_eagle3_drafter import check_graphed_equals_eager, setup

    target, head_dir = setup(checkpoints, tmp_path)
    check_graphed_equals_eager(target, head_dir, "cuda", torch.float32, tol=1e-4, projected=projected)
