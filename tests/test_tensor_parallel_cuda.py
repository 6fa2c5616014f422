"""Tensor parallelism on GPUs (NCCL): a one-rank NCCL group drives the leader's command path, and
the verifier at every TP size the machine's GPUs allow matches HF generate. Skips without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from model_factory import hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NCCL_GROUP_OF_ONE = textwrap.dedent("""
    import sys, torch, torch.distributed as dist
    from specdec.model.batch import ForwardBatch, causal_region
    from specdec.model.loader import load_model
    from specdec.model.runner import ModelRunner, TPLeader
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0, world_size=1,
                            device_id=torch.device("cuda:0"))
    model = load_model(sys.argv[1], torch.float32, torch.device("cuda"))
    leader, plain = TPLeader(model), ModelRunner(model)
    leader.allocate_kv(2, 64)
    plain.allocate_kv(2, 64)
    tokens = torch.randint(0, model.spec.vocab_size, (2, 9), device="cuda")
    pos = torch.arange(9, device="cuda").expand(2, -1)
    batch = ForwardBatch.build(tokens, pos, torch.tensor([0, 1], device="cuda"), pos,
                               torch.zeros(2, dtype=torch.long, device="cuda"),
                               causal_region(torch.tensor([9, 5], device="cuda"), 9))
    assert torch.equal(leader.forward(batch), plain.forward(batch))
    leader.shutdown()
    dist.destroy_process_group()
    print("nccl ok", dist.is_nccl_available())
""")


def test_nccl_group_of_one_runs_the_leader_path(checkpoints):
    from cluster import free_port

    out = subprocess.run([sys.executable, "-c", NCCL_GROUP_OF_ONE, str(checkpoints["llama-gqa"]), str(free_port())],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "NCCL_NVLS_ENABLE": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "nccl ok True" in out.stdout


@pytest.mark.parametrize("graphs", ["--cuda-graphs", "--no-cuda-graphs"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_cuda_tp_verifier_matches_hf(tp, graphs, checkpoints, start_cluster):
    """Every rank captures the verify graphs (their all-reduces inside) and replays them in step."""
    if torch.cuda.device_count() < tp:
        pytest.skip(f"needs {tp} GPUs; {torch.cuda.device_count()} visible")
    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, checkpoints["llama-gqa/draft"], device="cuda", dtype="float32",
                            verifier_extra=["--tp", str(tp), graphs])
    for mode, spec in [("off", {}), ("chain", {"k": 3}), ("tree", {"topk": 2, "depth": 3, "budget": 6})]:
        ids, _ = cluster.generate([1, 17, 42, 99, 5], 20, mode, **spec)
        assert ids == hf_greedy(target, [1, 17, 42, 99, 5], 20)
