"""CPU engines get their share of the cores: a cgroup quota caps what is available, `specdec
serve` splits the cores between its verifier and drafter, and the engine thread really runs its
torch work on the threads it was given (torch's setting holds per thread)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from specdec.cpu_threads import available_cpus, engine_executor, rank_threads, serve_split


def test_available_cpus_honours_a_cgroup_quota(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("100000 100000\n")          # docker --cpus 1
    assert available_cpus(cpu_max) == 1
    cpu_max.write_text("150000 100000\n")          # 1.5 CPUs: two threads, each throttled a little
    assert available_cpus(cpu_max) == min(affinity, 2)
    cpu_max.write_text("max 100000\n")             # no quota
    assert available_cpus(cpu_max) == affinity
    assert available_cpus(tmp_path / "absent") == affinity


def test_serve_split_gives_each_engine_a_share_that_fits():
    assert serve_split(1) == (1, 1) and serve_split(2) == (1, 1)
    assert serve_split(4) == (3, 1) and serve_split(16) == (12, 4)
    assert all(sum(serve_split(n)) == n for n in range(2, 65))
    assert rank_threads(8, 2) == 4 and rank_threads(1, 2) == 1


def busy_threads(work) -> int:
    """OS threads of this process that spent at least 50 ms of CPU while `work` ran."""
    def ticks() -> dict[str, int]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue   # the thread ended
            out[tid] = int(fields[11]) + int(fields[12])   # utime + stime, in clock ticks
        return out

    before = ticks()
    work()
    after = ticks()
    hz = os.sysconf("SC_CLK_TCK")
    return sum(1 for tid, t in after.items() if t - before.get(tid, 0) >= 0.05 * hz)


def matmuls() -> None:
    a = torch.randn(1536, 1536)
    deadline = time.perf_counter() + 1.0
    while time.perf_counter() < deadline:
        a @ a


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_the_engine_thread_runs_on_the_threads_it_was_given():
    cores, before = len(os.sched_getaffinity(0)), torch.get_num_threads()
    try:
        torch.set_num_threads(cores)   # what the main thread says must not leak in
        for threads in (1, 2) if cores >= 2 else (1,):
            executor = engine_executor("verifier", threads)
            try:
                assert executor.submit(busy_threads, matmuls).result() == threads
            finally:
                executor.shutdown()
            torch.set_num_threads(1)
    finally:
        torch.set_num_threads(before)
