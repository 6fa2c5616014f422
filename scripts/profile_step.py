"""Time one verifier step in isolation: B sequences, a draft of k tokens each (random, so mostly
rejected: the cost of a step does not depend on acceptance), per-step wall time with the device
synchronized, then the top operators from torch.profiler. For finding per-step overheads
(launches, syncs, JIT compiles) before and after a change.

    python scripts/profile_step.py --model DIR --device cuda --batch 1 16 --k 0 4
    python scripts/profile_step.py            (the embedded SmolLM2 target)
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
    a = p.parse_args()
    if a.model is None:
        from specdec.embedded_model import ensure_embedded_models

        a.model = ensure_embedded_models()[0]
    device = torch.device(a.device)
    dtype = DTYPES[a.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    engine = VerifierEngine(ModelRunner(load_model(a.model, dtype, device)), max(a.batch), 4096, 64)
    if a.cuda_graphs:
        engine.runner.capture_cuda_graphs(max(a.batch), tuple(sorted({k + 1 for k in a.k})))
    rng = random.Random(0)
    print(f"model={Path(a.model).name} device={device} dtype={dtype} cuda_graphs={a.cuda_graphs}")
    print("| batch | k | step ms p50 | step ms min |")
    print("|---|---|---|---|")
    for batch in a.batch:
        for k in a.k:
            ids = [f"s{i}" for i in range(batch)]
            prompt = [rng.randrange(engine.spec.vocab_size) for _ in range(a.prompt_len)]
            engine.step(VerifierStep(0, open=[OpenSequence(sid, prompt) for sid in ids]))
            run_steps(engine, ids, k, 3, rng)  # warm-up: compiles, allocator
            times = run_steps(engine, ids, k, a.steps, rng)
            print(f"| {batch} | {k} | {statistics.median(times):.2f} | {min(times):.2f} |", flush=True)
            if a.profile and (batch, k) == (a.batch[-1], a.k[-1]):
                activities = [torch.profiler.ProfilerActivity.CPU] + (
                    [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
                with torch.profiler.profile(activities=activities) as prof:
                    run_steps(engine, ids, k, 5, rng)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))
            engine.close(ids)


if __name__ == "__main__":
    main()
