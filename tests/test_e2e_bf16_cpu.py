"""bfloat16 on the CPU (BENCHMARKS.md "The CPU's matmuls": with AVX-512 BF16 its multi-token verify
steps and batches run faster than float32's): every mode, solo and batched, agrees with mode off up
to near-ties of the fp32 logits, and every emitted token is within the bf16 noise of the fp32
maximum, through real gRPC between CPU processes (the rule of tests/test_e2e_bf16_cuda.py). A bf16
verify step of several tokens rounds differently from a one-token step, so exact equality with
mode off is not expected: on the GPU --batch-invariant gives it, on the CPU nothing does yet."""

from __future__ import annotations

import torch
from half_precision_cluster import check_half_precision_cluster, wide  # noqa: F401  (wide: the fixture)


def test_bf16_cpu_modes_agree_up_to_near_ties(wide, start_cluster):  # noqa: F811
    target, draft = wide
    cluster = start_cluster(target, draft, device="cpu", dtype="bfloat16")
    assert cluster.info("verifier").dtype == "bfloat16"
    check_half_precision_cluster("wide-bf16-cpu", cluster, target, torch.bfloat16, device="cpu")
