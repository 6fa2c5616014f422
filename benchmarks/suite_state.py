"""A run's state: the rows so far (each streamed to stdout as it finishes, and results.json rewritten
so a run cut short still leaves its rows), the metadata, and the wall time of each phase."""

from __future__ import annotations

import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from tqdm import tqdm

from benchmarks.metrics import RunResult, attach_baselines


def _f(x, fmt: str) -> str:
    return "-" if x is None else fmt.format(x)


class SuiteState:
    def __init__(self, out_dir: Path, meta: dict, bar: tqdm) -> None:
        self.out_dir = out_dir
        self.meta = meta
        self.bar = bar
        self.rows: list[RunResult] = []
        self.reference: list[list[int]] | None = None  # the reference pass's outputs, max_new tokens each

    @contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        self.bar.set_postfix_str(name)
        try:
            yield
        finally:
            self.meta["timings"][name] = time.perf_counter() - t0

    def record(self, row: RunResult) -> None:
        self.rows.append(row)
        attach_baselines(self.rows)
        if row.config == "off" and self.reference is not None and row.pair == self.meta.get("pair"):
            # Low precision can flip a greedy argmax between batch shapes; then the controlled
            # drafter's reference (made at the largest batch) stops matching that sequence.
            same = sum(o == r for o, r in zip(row.outputs, self.reference)) / len(row.outputs)
            self.meta.setdefault("reference_same_as_off", {})[f"{row.path} C={row.concurrency}"] = same
        a = "real" if row.acceptance is None and row.config != "off" else _f(row.acceptance, "{:g}")
        self.bar.write(
            f"[{row.path}] {row.pair} | a={a} C={row.concurrency} {row.config}: {row.tok_s:.1f} tok/s, "
            f"TPOT p50/p99 {row.tpot_p50_ms:.1f}/{row.tpot_p99_ms:.1f} ms, accept len {row.accept_len:.2f}, "
            f"step {_f(row.step_ms, '{:.2f}')} ms, vs off {_f(row.speedup, '{:.2f}x')}, "
            f"same as off {_f(row.same_as_off, '{:.2f}')}", file=sys.stdout)
        sys.stdout.flush()
        self.bar.update()
        self.save()

    def save(self) -> None:
        data = {"meta": self.meta, "rows": [r.to_json() for r in self.rows]}
        tmp = self.out_dir / "results.json.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.out_dir / "results.json")
