"""Time one EAGLE-3 drafter step in isolation: B sequences, each step appending the tokens a verdict
committed (with their hidden-state rows, random) and drafting a chain or a tree, per-step wall time
with the device synchronized, then torch.profiler's top operators. The drafter's share of a
speculative step without gRPC around it (bench_serve's step split gives the round trip).

    python scripts/profile_draft.py --device cuda --cuda-graphs --batch 1 16 --shape "chain 4" "tree 4"
    python scripts/profile_draft.py --device cpu --batch 1 --profile
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

from drafter_svc.eagle3_engine import Eagle3DrafterEngine, build_eagle3_drafter  # noqa: E402
from drafter_svc.types import ChainShape, DrafterStep, DraftItem, TreeShape  # noqa: E402
from specdec.model.loader import DTYPES  # noqa: E402

SHAPES = {"chain 2": ChainShape(2), "chain 4": ChainShape(4), "tree 4": TreeShape(4, 5, 16)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Load:
    """B open sequences; each step commits `accepted` random tokens (rows included) and drafts."""

    def __init__(self, engine: Eagle3DrafterEngine, batch: int, prompt_len: int, rng: random.Random) -> None:
        self.engine, self.rng, self.step_no = engine, rng, 0
        self.vocab = engine.table.vocab_size
        self.lens = {f"s{i}": prompt_len for i in range(batch)}
        opened = [DraftItem(sid, n, self.tokens(n), [], ChainShape(1), hidden=self.rows(n - 1))
                  for sid, n in self.lens.items()]
        self.run(opened)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(n)]

    def rows(self, n: int) -> torch.Tensor:
        return torch.randn(n, self.engine.aux_width).to(self.engine.dtype)   # as the servicer decodes them: host

    def run(self, items: list[DraftItem]) -> None:
        self.step_no += 1
        result = self.engine.step(DrafterStep(self.step_no, items))
        assert not result.errors, result.errors

    def next_items(self, shape, accepted: int) -> list[DraftItem]:
        """The next step's items (made before the timer starts)."""
        items = []
        for sid, n in self.lens.items():
            items.append(DraftItem(sid, n + accepted, self.tokens(accepted), [], shape, hidden=self.rows(accepted)))
            self.lens[sid] = n + accepted
        return items


def time_steps(load: Load, shape, accepted: int, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        items = load.next_items(shape, accepted)
        sync(load.engine.device)
        t0 = time.perf_counter()
        load.run(items)
        sync(load.engine.device)
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help="target checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--head", help="EAGLE-3 head (default: the shipped one)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--shape", nargs="+", default=["chain 4", "tree 4"], choices=list(SHAPES))
    p.add_argument("--accepted", type=int, default=2, help="tokens a verdict commits per step (rows sent)")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--cuda-graphs", action="store_true")
    p.add_argument("--profile", action="store_true", help="torch.profiler's top operators for the last setting")
    a = p.parse_args()
    from specdec.embedded_head import embedded_head
    from specdec.embedded_model import ensure_embedded_models

    target = Path(a.target) if a.target else ensure_embedded_models()[0]
    device = torch.device(a.device)
    dtype = DTYPES[a.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    rng = random.Random(0)
    print(f"target={target.name} device={device} dtype={dtype} cuda_graphs={a.cuda_graphs} accepted={a.accepted}")
    print("| batch | shape | step ms p50 | p90 |")
    print("|---|---|---|---|")
    last = None
    for b in a.batch:
        engine = build_eagle3_drafter(target, Path(a.head) if a.head else embedded_head(), dtype, device, b, 2048)
        if a.cuda_graphs and device.type == "cuda":
            engine.capture_cuda_graphs()
        load = Load(engine, b, a.prompt_len, rng)
        for name in a.shape:
            time_steps(load, SHAPES[name], a.accepted, 5)   # warm-up
            t = sorted(time_steps(load, SHAPES[name], a.accepted, a.steps))
            print(f"| {b} | {name} | {statistics.median(t):.3f} | {t[int(0.9 * len(t))]:.3f} |")
            last = load, SHAPES[name]
    if a.profile and last:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            time_steps(last[0], last[1], a.accepted, 10)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        if device.type == "cuda":
            print(prof.key_averages().table(sort_by=key, row_limit=15))


if __name__ == "__main__":
    main()
