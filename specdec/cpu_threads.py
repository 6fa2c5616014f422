"""How many threads a CPU engine's torch work runs on.

torch's default is one thread per core of the machine, in every process. `specdec serve` runs a
verifier and a drafter on the same cores, and a container limited to N CPUs still sees all of the
host's: both then oversubscribe. So each engine gets its share of the cores instead (BENCHMARKS.md,
"Threads on the CPU", has what it did and did not change on the 2-core dev VM).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def available_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The cores this process may run on: its affinity, capped by a cgroup v2 CPU quota (docker
    --cpus, compose's `cpus:`), rounded up."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = cpu_max.read_text().split()[:2]
        if quota != "max":
            cores = min(cores, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass   # no cgroup v2 quota to honour
    return max(1, cores)


def serve_split(cores: int) -> tuple[int, int]:
    """(verifier, drafter) threads when one machine runs both: a quarter of the cores for the
    drafter (at least one), the rest for the verifier, whose forward is the larger."""
    drafter = max(1, cores // 4)
    return max(1, cores - drafter), drafter


def serve_flags() -> dict[str, list[str]]:
    """--cpu-threads for a verifier and a drafter on one machine, by role (a service applies them
    only when it runs on the CPU)."""
    verifier, drafter = serve_split(available_cpus())
    return {"verifier": ["--cpu-threads", str(verifier)], "drafter": ["--cpu-threads", str(drafter)]}


def rank_threads(cpu_threads: int, tp: int) -> int:
    """Threads per tensor-parallel rank: `cpu_threads` (0: every available core) over the ranks,
    which share those cores."""
    return max(1, (cpu_threads or available_cpus()) // tp)


def use_threads(n: int) -> None:
    """On the calling thread only: OpenMP gives each thread its own team, so a thread started
    later keeps torch's default whatever the main thread set."""
    import torch

    torch.set_num_threads(n)


def engine_executor(role: str, threads: int | None) -> ThreadPoolExecutor:
    """The one thread that runs a service's engine work (every step, and so every collective),
    with `threads` torch threads when given (the CPU)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{role}-engine",
                              initializer=use_threads if threads else None, initargs=(threads,) if threads else ())
