"""The tensor-parallel command path on CPU (gloo): the other ranks execute what rank 0's TPLeader
sends, with the same arguments. CUDA-graph capture travels this way too: every rank must capture
the same shapes in the same order, or their captured all-reduces would pair up wrongly. And the
all-reduce benchmark runs the collectives of a verifier step."""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from cluster import free_port

from specdec.model.runner import ModelRunner, TPLeader, follow


TIMEOUT = timedelta(seconds=60)   # a rank that never comes fails the test instead of hanging it


class _Recorder:
    """A follower's runner that records the commands it is asked to run."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def allocate_kv(self, num_slots: int, slot_len: int) -> None:
        self.calls.append(("allocate_kv", num_slots, slot_len))

    def capture_cuda_graphs(self, max_batch: int, query_lens: tuple[int, ...], log=None) -> None:
        self.calls.append(("capture_cuda_graphs", max_batch, query_lens))


def _follower(port: int, out) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2, timeout=TIMEOUT)
    runner = _Recorder()
    follow(runner)
    out.put(runner.calls)
    dist.destroy_process_group()


def test_followers_capture_the_leaders_graph_shapes(monkeypatch):
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    follower = ctx.Process(target=_follower, args=(port, out))
    follower.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2, timeout=TIMEOUT)
    try:
        mine: list[tuple] = []
        monkeypatch.setattr(ModelRunner, "allocate_kv", lambda self, n, length: mine.append(("allocate_kv", n, length)))
        monkeypatch.setattr(ModelRunner, "capture_cuda_graphs",
                            lambda self, b, lens, log=None: mine.append(("capture_cuda_graphs", b, lens)))
        leader = object.__new__(TPLeader)   # the command path only: no model behind it
        leader.device, leader.stopping = torch.device("cpu"), threading.Event()
        leader.allocate_kv(5, 96)
        leader.capture_cuda_graphs(48, (1, 2, 3, 5, 9))
        leader.shutdown()
        follower.join(60)
        assert follower.exitcode == 0
        expected = [("allocate_kv", 5, 96), ("capture_cuda_graphs", 48, (1, 2, 3, 5, 9))]
        assert mine == expected
        assert out.get(timeout=10) == expected
    finally:
        dist.destroy_process_group()
        if follower.is_alive():
            follower.kill()


def test_allreduce_benchmark_runs_a_verifier_steps_collectives():
    """scripts/bench_allreduce.py on gloo: 2 all-reduces per layer and one logits all-gather, and
    the bytes a rank sends for them (SmolLM2: 30 layers x 576 bf16 values, 49152 / 2 fp32 logits)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import bench_allreduce

    rows = bench_allreduce.main(["--device", "cpu", "--tp", "2", "--shape", "smollm2-135m", "--tokens", "1", "4",
                                 "--steps", "2", "--json"])
    assert [r["tokens"] for r in rows] == [1, 4] and all(r["collectives_per_step"] == 61 for r in rows)
    per_token = (60 * 576 * 2 + 24576 * 4) / 1e6     # ring all-reduce at TP 2 sends the whole tensor once
    assert [r["mb_sent_per_rank"] for r in rows] == [pytest.approx(per_token), pytest.approx(4 * per_token)]
    assert all(r["ms_p50"] > 0 for r in rows)


def test_profile_step_times_a_tensor_parallel_verifier(checkpoints):
    """scripts/profile_step.py --tp 2 drives the TP leader with its follower spawned, and exits."""
    import subprocess

    script = Path(__file__).resolve().parents[1] / "scripts" / "profile_step.py"
    done = subprocess.run([sys.executable, str(script), "--model", str(checkpoints["llama-gqa"]), "--device", "cpu",
                           "--tp", "2", "--batch", "1", "2", "--k", "0", "3", "--steps", "2", "--prompt-len", "8"],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 4 and " tp=2" in done.stdout, done.stdout
