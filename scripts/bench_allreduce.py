"""The collectives of one tensor-parallel verifier step, timed alone.

Per decoder layer the verifier all-reduces the step's hidden states twice ([tokens, hidden]: after
attention and after the MLP; specdec/model/llama.py), then all-gathers the logits' vocabulary
shards once ([tokens, vocab / tp]); tokens = batch x query length (1 + draft tokens). This runs
exactly that sequence of collectives for a model shape, one rank per GPU over NCCL (gloo on the
CPU), and reports per step: the collectives' time, and the bytes each rank sends. Set beside the
verifier's step time at TP 1 and TP 2 (the sweep's verify_ms), it says what the all-reduces cost.

    python scripts/bench_allreduce.py --tp 2 --tokens 1 32 160        # 8B shape, bf16, GPUs 0..tp-1
    python scripts/bench_allreduce.py --device cpu --tp 2 --shape smollm2-135m --tokens 1 8
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # allow running without installing
from random_checkpoint import SHAPES  # noqa: E402

from specdec.launcher import free_port  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 160], help="tokens per step (batch x query)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=20, help="timed steps per size (after 3 warm-up steps)")
    p.add_argument("--json", action="store_true", help="one JSON object per size instead of a table")
    return p.parse_args(argv)


def step_collectives(hidden: torch.Tensor, logits: torch.Tensor, gathered: list[torch.Tensor], layers: int) -> None:
    """One verifier step's collectives, in the verifier's order."""
    for _ in range(layers):
        dist.all_reduce(hidden)   # attention output
        dist.all_reduce(hidden)   # MLP output
    dist.all_gather(gathered, logits)


def _rank(rank: int, a: argparse.Namespace, port: int, out) -> None:
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    device = torch.device(f"cuda:{rank}" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=a.tp, device_id=device if cuda else None, timeout=timedelta(minutes=2))
    shape, dtype = SHAPES[a.shape], getattr(torch, a.dtype)
    layers, h = shape["num_hidden_layers"], shape["hidden_size"]
    shard = -(-shape["vocab_size"] // a.tp)
    rows = []
    for tokens in a.tokens:
        hidden = torch.randn(tokens, h, dtype=dtype, device=device)
        logits = torch.randn(tokens, shard, dtype=torch.float32, device=device)
        gathered = [torch.empty_like(logits) for _ in range(a.tp)]
        times = []
        for i in range(3 + a.steps):
            if cuda:
                torch.cuda.synchronize(device)
            dist.barrier()
            t0 = time.perf_counter()
            step_collectives(hidden, logits, gathered, layers)
            if cuda:
                torch.cuda.synchronize(device)
            if i >= 3:
                times.append(time.perf_counter() - t0)
        ring = 2 * (a.tp - 1) / a.tp    # the share of a tensor each rank sends in a ring all-reduce
        sent = 2 * layers * ring * hidden.numel() * hidden.element_size() + (a.tp - 1) * logits.numel() * 4
        rows.append({"tp": a.tp, "shape": a.shape, "tokens": tokens, "collectives_per_step": 2 * layers + 1,
                     "ms_p50": 1e3 * statistics.median(times), "ms_min": 1e3 * min(times),
                     "mb_sent_per_rank": sent / 1e6})
    if rank == 0:
        out.put(rows)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse_args(argv)
    if a.device == "cuda" and torch.cuda.device_count() < a.tp:
        raise SystemExit(f"--tp {a.tp} needs {a.tp} GPUs; {torch.cuda.device_count()} are visible")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")   # the device notes: NVLink multicast stays off
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, a, port, out)) for r in range(a.tp)]
    for p in procs:
        p.start()
    rows = None
    while rows is None:
        try:
            rows = out.get(timeout=1)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                for p in procs:
                    p.kill()
                raise SystemExit(f"a rank failed: exit codes {[p.exitcode for p in procs]}") from None
    for p in procs:
        p.join(60)
    if a.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(f"{a.shape}, TP {a.tp}, {a.device}, {a.dtype} hidden states: "
              f"{rows[0]['collectives_per_step']} collectives per verifier step")
        print("| tokens per step | collectives p50 ms | min ms | MB sent per rank |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['tokens']} | {r['ms_p50']:.3f} | {r['ms_min']:.3f} | {r['mb_sent_per_rank']:.2f} |")
    return rows


if __name__ == "__main__":
    main()
