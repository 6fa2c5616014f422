"""Start the ranks of a tensor-parallel engine: rank 0 in this process, the others as spawned
processes following its commands. A rank that dies takes the whole service down with a clear
log line (never a hang): rank 0 watches its children, the children watch rank 0."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from specdec.config import EngineServiceConfig
from specdec.cpu_threads import rank_threads, use_threads
from specdec.log import configure_logging
from specdec.model.loader import DTYPES, load_model
from specdec.model.runner import ModelRunner, TPLeader, follow

WATCH_SECONDS = 0.5
COLLECTIVE_TIMEOUT = timedelta(minutes=10)  # model loading on other ranks may take a while


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_device(cfg: EngineServiceConfig, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if cfg.device == "cuda" else torch.device("cpu")


def _init(cfg: EngineServiceConfig, rank: int, port: int) -> torch.device:
    device = _rank_device(cfg, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # ranks share the cores: no oversubscription
        use_threads(rank_threads(cfg.cpu_threads, cfg.tp))
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
        rank=rank, world_size=cfg.tp, timeout=COLLECTIVE_TIMEOUT, device_id=device if device.type == "cuda" else None,
    )
    return device


def build_runner(cfg: EngineServiceConfig, log) -> ModelRunner:
    dtype = DTYPES[cfg.dtype]
    if cfg.tp == 1:
        return ModelRunner(load_model(cfg.model_dir, dtype, _rank_device(cfg, 0),
                                      batch_invariant=cfg.batch_invariant))
    if cfg.device == "cuda" and torch.cuda.device_count() < cfg.tp:
        raise SystemExit(f"--tp {cfg.tp} needs {cfg.tp} GPUs; {torch.cuda.device_count()} are visible")
    port = _free_port()
    ctx = mp.get_context("spawn")
    workers = [ctx.Process(target=_worker_main, args=(cfg, rank, port, os.getpid()), name=f"{cfg.role}-rank{rank}")
               for rank in range(1, cfg.tp)]
    for w in workers:
        w.start()
    stopping = threading.Event()
    threading.Thread(target=_watch_workers, args=(workers, stopping, log), daemon=True).start()
    device = _init(cfg, 0, port)
    log.info("tensor parallel group ready", world=cfg.tp, backend=dist.get_backend())
    leader = TPLeader(load_model(cfg.model_dir, dtype, device, rank=0, world=cfg.tp,
                                 batch_invariant=cfg.batch_invariant))
    leader.stopping = stopping
    return leader


def _watch_workers(workers: list, stopping: threading.Event, log) -> None:
    while not stopping.is_set():
        for w in workers:
            if not w.is_alive() and not stopping.is_set():
                log.error("tensor-parallel rank died; stopping this service", rank=w.name, exit_code=w.exitcode)
                os._exit(1)
        time.sleep(WATCH_SECONDS)


def _watch_leader(leader_pid: int, log) -> None:
    while True:
        if os.getppid() != leader_pid:
            log.error("rank 0 is gone; this rank exits")
            os._exit(1)
        time.sleep(WATCH_SECONDS)


def _worker_main(cfg: EngineServiceConfig, rank: int, port: int, leader_pid: int) -> None:
    log = configure_logging(f"{cfg.role}-rank{rank}")
    threading.Thread(target=_watch_leader, args=(leader_pid, log), daemon=True).start()
    device = _init(cfg, rank, port)
    runner = ModelRunner(load_model(cfg.model_dir, DTYPES[cfg.dtype], device, rank=rank, world=cfg.tp,
                                    batch_invariant=cfg.batch_invariant))
    try:
        follow(runner)
    finally:
        dist.destroy_process_group()
