"""Time one verifier step in isolation: B sequences, a draft of k tokens each (random, so mostly
rejected: the cost of a step does not depend on acceptance), per-step wall time with the device
synchronized, then the top operators from torch.profiler. For finding per-step overheads
(launches, syncs, JIT compiles) before and after a change.

Also the forward alone (the model on the step's shape, no engine work around it) and, on CUDA,
the memory-traffic limit of a step: weight and KV bytes read over the copy bandwidth measured in
the same run; "of limit" = limit / step time.

    python scripts/profile_step.py --model DIR --device cuda --batch 1 16 --k 0 4
    python scripts/profile_step.py            (the embedded SmolLM2 target)
    python scripts/profile_step.py --device cpu --batch 1 --k 0 2 4 --cpu-threads 1   (as a CPU service runs it)
    python scripts/profile_step.py --model DIR --tp 2 --cuda-graphs   (rank 0's shard: bytes and limit per GPU)

With --admit L..., also steps that open a sequence with a prompt of L tokens while verifying the
batch (its prefill runs in the same step, as when a request arrives under load): step time with the
prompt prefilled eagerly, with --cuda-graphs by a prefill graph, and folded into the verify forward
(--fold-prefill) where its rows fit, against no admission.

    python scripts/profile_step.py --model DIR --batch 1 32 --k 0 4 --cuda-graphs --admit 64 128
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.model.batch import ForwardBatch, causal_region  # noqa: E402
from specdec.model.loader import DTYPES, load_model  # noqa: E402
from specdec.model.runner import ModelRunner  # noqa: E402
from specdec.tree import DraftTree  # noqa: E402
from verifier_svc.engine import VerifierEngine  # noqa: E402
from verifier_svc.types import OpenSequence, VerifierStep, VerifyItem  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_steps(engine: VerifierEngine, ids: list[str], k: int, steps: int, rng: random.Random) -> list[float]:
    vocab = engine.spec.vocab_size
    times = []
    for i in range(steps):
        items = [VerifyItem(sid, len(engine.table.get(sid).tokens),
                            DraftTree.chain([rng.randrange(vocab) for _ in range(k)])) for sid in ids]
        sync(engine.device)
        t0 = time.perf_counter()
        engine.step(VerifierStep(i + 1, verify=items))
        sync(engine.device)
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def run_admitting_steps(engine: VerifierEngine, ids: list[str], k: int, steps: int, rng: random.Random,
                        prompt_len: int) -> list[float]:
    """run_steps, each step also opening (then closing) a sequence with a fresh prompt."""
    vocab = engine.spec.vocab_size
    times = []
    for i in range(steps):
        items = [VerifyItem(sid, len(engine.table.get(sid).tokens),
                            DraftTree.chain([rng.randrange(vocab) for _ in range(k)])) for sid in ids]
        new = OpenSequence(f"admitted{i}", [rng.randrange(vocab) for _ in range(prompt_len)])
        sync(engine.device)
        t0 = time.perf_counter()
        engine.step(VerifierStep(i + 1, open=[new], verify=items))
        sync(engine.device)
        times.append(1e3 * (time.perf_counter() - t0))
        engine.close([new.seq_id])
    return times


def time_admissions(engine: VerifierEngine, ids: list[str], k: int, steps: int, rng: random.Random,
                    prompt_lens: list[int], plain_ms: float) -> list[str]:
    """-> one table row per prompt length: step ms p50 admitting it by an eager prefill, by a prefill
    graph, and folded into the verify forward (--fold-prefill; '-' where its rows would not fit)."""
    rows, graphs = [], engine.runner.prefill_graphs
    for n in prompt_lens:
        variants = {"eager": (None, False), "graph": (graphs, False) if graphs is not None else None,
                    "folded": (graphs, True) if len(ids) + -(-n // (k + 1)) <= engine.graph_rows else None}
        row = f"| {len(ids)} | {k} | {n} | {plain_ms:.2f} |"
        for variant in variants.values():
            if variant is None:
                row += " - | - |"
                continue
            engine.runner.prefill_graphs, engine.fold_prefill = variant
            run_admitting_steps(engine, ids, k, 2, rng, n)  # warm-up
            ms = statistics.median(run_admitting_steps(engine, ids, k, steps, rng, n))
            row += f" {ms:.2f} | {ms - plain_ms:+.2f} |"
        engine.runner.prefill_graphs, engine.fold_prefill = graphs, False
        rows.append(row)
    return rows


def time_forward(engine: VerifierEngine, ids: list[str], n: int, steps: int) -> list[float]:
    """The model alone on the verify shape [len(ids), n] (graph replay when captured)."""
    states = [engine.table.get(sid) for sid in ids]
    dev = engine.device
    start = torch.tensor([len(st.tokens) - 1 for st in states], device=dev)
    pos = start[:, None] + torch.arange(n, device=dev)
    batch = ForwardBatch.build(torch.zeros_like(pos), pos, engine.table.slots(states, dev), pos, start,
                               causal_region(torch.full((len(ids),), n, device=dev), n))
    times = []
    for _ in range(steps + 3):
        sync(dev)
        t0 = time.perf_counter()
        engine.runner.forward(batch)
        sync(dev)
        times.append(1e3 * (time.perf_counter() - t0))
    return times[3:]


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a large device copy, read + write counted (the usual convention)."""
    src = torch.empty(2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    sync(device)
    return 2 * 10 * src.numel() / (time.perf_counter() - t0)


def bytes_per_step(engine: VerifierEngine, batch: int, context: int) -> int:
    """Weights read once per step (the embedding table only by rows, unless tied to the head)
    plus each sequence's KV."""
    model = engine.runner.model
    seen, total = set(), 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if name.endswith("embed_tokens.weight") and p.data_ptr() != model.lm_head.weight.data_ptr():
            continue
        total += p.numel() * p.element_size()
    spec = engine.spec
    kv = 2 * spec.num_layers * model.layout.kv_heads * spec.head_dim * engine.runner.dtype.itemsize  # this rank's
    return total + batch * context * kv


def make_runner(a, dtype_name: str, device: torch.device) -> ModelRunner:
    """One rank's runner, or with --tp the tensor-parallel leader (the other ranks are spawned and
    follow it, exactly as in the verifier service)."""
    if a.tp == 1:
        return ModelRunner(load_model(a.model, DTYPES[dtype_name], device, fuse=False if a.no_fuse else None,
                                      batch_invariant=a.batch_invariant))
    import structlog

    from specdec.config import EngineServiceConfig
    from specdec.tensor_parallel import build_runner

    cfg = EngineServiceConfig("verifier", Path(a.model), "", device.type, dtype_name,
                              max(a.batch), 4096, 64, a.tp, batch_invariant=a.batch_invariant)
    return build_runner(cfg, structlog.get_logger(service="profile_step"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--k", type=int, nargs="+", default=[0, 4], help="draft tokens per sequence (0 = mode off)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--profile", action="store_true", help="print torch.profiler's top operators for the last setting")
    p.add_argument("--cuda-graphs", action="store_true", help="capture the verify forwards as CUDA graphs first")
    p.add_argument("--admit", type=int, nargs="*", default=[], metavar="L",
                   help="also time steps that admit a prompt of L tokens (eager and graphed prefill, and folded "
                        "into the verify forward)")
    p.add_argument("--no-fuse", action="store_true", help="the reference forward (separate projections, "
                   "unfused norms and RoPE) instead of the fused one")
    p.add_argument("--batch-invariant", action="store_true", help="the batch-invariant matmuls and attention")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (GPUs 0..tp-1, or gloo processes on "
                   "cpu); bytes and the limit are then rank 0's shard: the share of the limit reached per GPU")
    p.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="on cpu: run everything on an engine thread with N torch threads, as a service does "
                        "(default: the main thread, torch's default threads)")
    a = p.parse_args()
    if a.cpu_threads:
        from specdec.cpu_threads import engine_executor

        with engine_executor("profile", a.cpu_threads) as executor:
            return executor.submit(profile, a, p).result()
    profile(a, p)


def profile(a: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if a.tp > 1 and a.no_fuse:
        p.error("--no-fuse applies to one rank only")
    if a.model is None:
        from specdec.embedded_model import ensure_embedded_models

        a.model = ensure_embedded_models()[0]
    device = torch.device(a.device)
    dtype_name = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = DTYPES[dtype_name]
    # With --admit: graphs for the rows a folded prompt adds (fold_prefill is switched per column)
    engine = VerifierEngine(make_runner(a, dtype_name, device), max(a.batch) + bool(a.admit), 4096, 64,
                            fold_prefill=bool(a.admit))
    engine.fold_prefill = False
    if a.cuda_graphs:
        engine.runner.capture_cuda_graphs(engine.graph_rows if a.admit else max(a.batch),
                                          tuple(sorted({k + 1 for k in a.k})))
    rng = random.Random(0)
    bandwidth = copy_bandwidth(device) if device.type == "cuda" else None
    print(f"model={Path(a.model).name} device={device} dtype={dtype} cuda_graphs={a.cuda_graphs} "
          f"threads={torch.get_num_threads()} "
          f"fused={engine.runner.model.fused} batch_invariant={a.batch_invariant} tp={engine.runner.model.layout.world}"
          + (f" copy_bandwidth={bandwidth / 1e12:.2f} TB/s" if bandwidth else ""))
    print("| batch | k | step ms p50 | step ms min | forward ms p50 | limit ms | step of limit | forward of limit |")
    print("|---|---|---|---|---|---|---|---|")
    admissions = []   # --admit's table rows
    for batch in a.batch:
        for k in a.k:
            ids = [f"s{i}" for i in range(batch)]
            prompt = [rng.randrange(engine.spec.vocab_size) for _ in range(a.prompt_len)]
            engine.step(VerifierStep(0, open=[OpenSequence(sid, prompt) for sid in ids]))
            run_steps(engine, ids, k, 3, rng)  # warm-up: compiles, allocator
            times = run_steps(engine, ids, k, a.steps, rng)
            fwd = statistics.median(time_forward(engine, ids, k + 1, a.steps))
            step = statistics.median(times)
            row = f"| {batch} | {k} | {step:.2f} | {min(times):.2f} | {fwd:.2f} |"
            if bandwidth:
                limit = 1e3 * bytes_per_step(engine, batch, a.prompt_len) / bandwidth
                row += f" {limit:.2f} | {limit / step:.0%} | {limit / fwd:.0%} |"
            print(row, flush=True)
            admissions += time_admissions(engine, ids, k, a.steps, rng, a.admit, step)
            if a.profile and (batch, k) == (a.batch[-1], a.k[-1]):
                activities = [torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
                with torch.profiler.profile(activities=activities) as prof:
                    run_steps(engine, ids, k, 5, rng)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
                if device.type == "cuda":
                    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=25))
            engine.close(ids)
    if admissions:
        print("\nSteps admitting a prompt (prefilled in the step), ms p50:")
        print("| batch | k | prompt | no admission | eager prefill | added | prefill graph | added | folded | added |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        print("\n".join(admissions))
    engine.runner.shutdown()   # the other ranks exit


if __name__ == "__main__":
    main()
