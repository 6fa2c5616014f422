"""Tensor-parallel verifier on CPU (gloo): token-identical to TP=1 and to HF generate in every
mode, KV heads split or replicated, and a dead rank stops the service instead of hanging it."""

from __future__ import annotations

import os
import signal
import time

import pytest
from model_factory import hf_greedy

from specdec.model.parallel import TPLayout
from specdec.model.spec import ModelSpec

MODES = [("off", {}), ("chain", {"k": 3}), ("chain", {"k": 3, "overlap": False}),
         ("tree", {"topk": 2, "depth": 3, "budget": 6})]
PROMPTS = [[1, 17, 42, 99, 5], list(range(100, 121))]


@pytest.mark.parametrize("shape, tp", [("llama-gqa", 2), ("qwen2-bias", 2), ("llama-tied", 3)])
def test_tp_matches_hf_generate(shape, tp, checkpoints, start_cluster):
    target = checkpoints[shape]
    cluster = start_cluster(target, checkpoints[f"{shape}/draft"], verifier_extra=["--tp", str(tp)])
    for prompt in PROMPTS:
        expected = hf_greedy(target, prompt, 20)
        for mode, spec in MODES:
            ids, _ = cluster.generate(prompt, 20, mode, **spec)
            assert ids == expected, f"tp={tp} {mode} {spec}"


def test_layouts_split_or_replicate_kv_heads(checkpoints):
    gqa = ModelSpec.from_pretrained(checkpoints["llama-gqa"])        # 4 heads, 2 KV heads
    qwen = ModelSpec.from_pretrained(checkpoints["qwen2-bias"])      # 4 heads, 1 KV head
    assert [(lay.heads, lay.kv_heads, lay.kv_first) for lay in (TPLayout.for_rank(gqa, r, 2) for r in range(2))] == [
        (2, 1, 0), (2, 1, 1)]
    assert [(lay.kv_heads, lay.kv_first) for lay in (TPLayout.for_rank(gqa, r, 4) for r in range(4))] == [
        (1, 0), (1, 0), (1, 1), (1, 1)]                              # each KV head on two ranks
    assert all(TPLayout.for_rank(qwen, r, 2).kv_first == 0 for r in range(2))
    assert "must divide the 4 attention heads" in TPLayout.problem(gqa, 3)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def test_dead_rank_stops_the_verifier(checkpoints, start_cluster):
    cluster = start_cluster(checkpoints["llama-gqa"], None, verifier_extra=["--tp", "2"])
    verifier = cluster.procs["verifier"]
    workers = [p for p in _children(verifier.pid)
               if "spawn_main" in open(f"/proc/{p}/cmdline").read().replace("\0", " ")]
    assert workers, "no tensor-parallel worker process found"
    os.kill(workers[0], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while verifier.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert verifier.returncode not in (None, 0)
    assert "tensor-parallel rank died" in (cluster.log_dir / "verifier.log").read_text()
