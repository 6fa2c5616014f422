"""The tensor-parallel command path on CPU (gloo): the other ranks execute what rank 0's TPLeader
sends, with the same arguments. CUDA-graph capture travels this way too: every rank must capture
the same shapes in the same order, or their captured all-reduces would pair up wrongly."""

from __future__ import annotations

import multiprocessing as mp
import threading

import torch
import torch.distributed as dist
from cluster import free_port

from specdec.model.runner import ModelRunner, TPLeader, follow


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
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
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
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
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
