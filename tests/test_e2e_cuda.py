"""The CUDA path end to end: verifier and drafter on the GPU, three processes, real gRPC,
token-identical to HF transformers generate in every mode. Skips without CUDA."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from model_factory import hf_greedy
from test_e2e_lossless import LARGE_MODES, MODES, check_every_mode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("shape", ["llama-gqa", "qwen2-bias"])
def test_cuda_every_mode_matches_hf_generate(shape, checkpoints, start_cluster):
    target = checkpoints[shape]
    # fp32 without TF32: the same arithmetic class as the CPU reference, so argmax agrees.
    cluster = start_cluster(target, checkpoints[f"{shape}/draft"], device="cuda", dtype="float32")
    assert cluster.info("verifier").device == "cuda"
    check_every_mode(cluster, target, MODES + LARGE_MODES)


def test_cuda_concurrent_batch(checkpoints, start_cluster):
    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, checkpoints["llama-gqa/draft"], device="cuda", dtype="float32")
    jobs = [([(5 * i + j * 11) % 380 + 2 for j in range(2 + i % 7 * 3)], 6 + (i * 7) % 30, *MODES[i % len(MODES)])
            for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda j: cluster.generate(j[0], j[1], j[2], **j[3]), jobs))
    for (prompt, n, mode, spec), (ids, _) in zip(jobs, results):
        assert ids == hf_greedy(target, prompt, n), f"{mode} {spec}"
