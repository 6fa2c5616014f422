"""The GPU benchmark suite in one command.

    python -m benchmarks.run --device cuda            # default grid (benchmarks/grid.py), ~8 min on one H200
    python -m benchmarks.run --device cuda --quick    # smoke run
    python -m benchmarks.run --device cpu --tiny      # the whole pipeline on tiny random models
    python -m benchmarks.run --parts inprocess gateway --acceptance 0.8 --concurrency 1 16 --configs off "chain k=4"

Phases: random 8B/1B-shaped checkpoints (kept in --ckpt-dir) -> copy bandwidth -> the verifier
process starts while the in-process engines load -> reference pass (mode off, in-process: the
target's own continuations, written to the reference file) -> per acceptance value a controlled
drafter process and a gateway start -> every cell in-process, then through the gateway -> Hugging
Face baselines -> the SmolLM2 pair (real acceptance) -> report. Rows stream to stdout as they
finish; results.json (rewritten after every row), the report section and the figures go to
--out-dir, and the section replaces the marked one in --report (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import gc
import shlex
import shutil
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks import report
from benchmarks.grid import CONFIGS, Cell, Plan, build_plan
from benchmarks.metrics import RunResult, summarize
from benchmarks.models import REPO, EngineSettings, ModelPair, embedded_pair, random_pair, random_prompts
from benchmarks.suite_state import SuiteState

PARTS = ("inprocess", "gateway", "hf", "smollm2")
SHM_NEEDED = 24 << 30  # the 8B and 1B checkpoints (18.6 GB) with room to spare


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float64 for --tiny, else float32")
    p.add_argument("--tiny", action="store_true", help="tiny random shapes instead of 8B/1B (CPU runs, tests)")
    p.add_argument("--quick", action="store_true", help="a reduced grid")
    p.add_argument("--full", action="store_true", help="every acceptance x concurrency x configuration")
    p.add_argument("--acceptance", type=float, nargs="+", help="acceptance values (crossed with the rest)")
    p.add_argument("--concurrency", type=int, nargs="+", help="concurrency values")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), help="speculation configurations")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="prompts and the controlled drafter's keep draws")
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "out")
    p.add_argument("--report", type=Path, default=REPO / "BENCHMARKS.md", help="markdown file to put the section in")
    p.add_argument("--no-report", action="store_true", help="leave --report alone (the section is still in --out-dir)")
    p.add_argument("--ckpt-dir", type=Path, default=None,
                   help="random checkpoints, written once and reused (default: /dev/shm when it has room, "
                        "removed afterwards unless --keep-checkpoints; else the temp dir)")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="service logs and the reference file (default: a temp dir)")
    return p.parse_args(argv)


def checkpoint_root(a: argparse.Namespace) -> tuple[Path, bool]:
    """(folder, remove it afterwards): memory-backed /dev/shm writes and reloads 16 GB in seconds."""
    if a.ckpt_dir is not None:
        return a.ckpt_dir, False
    shm = Path("/dev/shm")
    if not a.tiny and shm.is_dir() and ((shm / "specdec-bench").exists() or shutil.disk_usage(shm).free > SHM_NEEDED):
        return shm / "specdec-bench", not a.keep_checkpoints
    return Path(tempfile.gettempdir()) / "specdec-bench", False


def machine(device: str) -> tuple[str, str]:
    """(machine description, GPU name or "CPU"); the description names the CPU and how fast it runs
    the services' Python (benchmarks/host_speed.py): GPU hosts of one kind differ in it."""
    import os

    from benchmarks.host_speed import describe

    host = describe()
    if device == "cuda":
        name = torch.cuda.get_device_name()
        return f"{name} ({os.cpu_count()} CPU cores: {host})", name
    return f"{os.cpu_count()} CPU cores ({host}), no GPU", "CPU"


def versions() -> dict:
    out = {"torch": torch.__version__}
    for mod in ("triton", "transformers"):
        try:
            out[mod] = __import__(mod).__version__
        except ImportError:
            out[mod] = None
    return out


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    plan = build_plan(a.acceptance, a.concurrency, a.configs, a.quick, a.full)
    dtype, work, meta = start_run(a, "benchmarks.run", argv)
    parts = set(a.parts)
    inprocess = [c for c in plan.cells if c.config.mode != "auto"]
    total = (len(plan.cells) * ("gateway" in parts) + len(inprocess) * ("inprocess" in parts) + 2 * ("hf" in parts)
             + (len(plan.smollm2) + 2) * ("smollm2" in parts))
    state = SuiteState(a.out_dir, meta, tqdm(total=total, desc="benchmark cells", file=sys.stderr))
    print(f"benchmark suite: {total} rows, device {meta['machine']}, dtype {dtype}; logs and reference in {work}",
          flush=True)
    try:
        if parts & {"inprocess", "gateway", "hf"} and plan.cells:
            _random_pair_parts(a, plan, parts, dtype, work, state)
        if "smollm2" in parts and plan.smollm2:
            _smollm2_part(a, plan, work, state)
    finally:  # what was measured is kept, and reported, whatever failed later
        state.bar.close()
        state.save()
        (a.out_dir / "section.md").write_text(report.section(state.rows, meta, a.out_dir))
    if not a.no_report:
        report.install(a.out_dir, a.report)
    print(f"\nresults: {a.out_dir / 'results.json'}; section: {a.out_dir / 'section.md'}"
          + ("" if a.no_report else f"; report: {a.report}"), flush=True)
    print("timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in meta["timings"].items()), flush=True)
    return a.out_dir / "results.json"


def start_run(a: argparse.Namespace, module: str, argv: list[str]) -> tuple[str, Path, dict]:
    """A run's dtype, work directory (made) and metadata (command, date, machine, versions)."""
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float64" if a.tiny else "float32")
    a.out_dir.mkdir(parents=True, exist_ok=True)
    work = a.work_dir or Path(tempfile.mkdtemp(prefix="specdec-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    desc, gpu = machine(a.device)
    meta = {"command": shlex.join(["python", "-m", module, *argv]), "date": time.strftime("%Y-%m-%d"),
            "machine": desc, "gpu": gpu, "dtype": dtype, "max_new_tokens": a.max_new_tokens, "timings": {},
            **versions()}
    return dtype, work, meta


def _random_pair_parts(a, plan: Plan, parts: set, dtype: str, work: Path, state: SuiteState) -> None:
    root, remove = checkpoint_root(a)
    with state.phase("checkpoints"):
        pair = random_pair(root, a.tiny, a.device)
    try:
        _random_pair_cells(a, plan, parts, dtype, work, state, pair)
    finally:
        if remove:
            shutil.rmtree(root, ignore_errors=True)


def _random_pair_cells(a, plan: Plan, parts: set, dtype: str, work: Path, state: SuiteState, pair: ModelPair) -> None:
    from benchmarks.gateway_runs import Services
    from benchmarks.inprocess import load_engines, run_inprocess
    from benchmarks.roofline import copy_bandwidth, step_traffic
    from specdec.config import ControlledAcceptance

    meta = state.meta
    lengths = (4, 12) if a.tiny else (32, 96)
    spec_vocab = 512 if a.tiny else 128256
    prompts = random_prompts(plan.max_concurrency, spec_vocab, lengths, a.seed)
    ref_len = a.max_new_tokens + plan.lookahead
    settings = EngineSettings(max_sequences=plan.max_concurrency, cuda_graphs=a.device == "cuda",
                              max_context=-(-(lengths[1] + ref_len + 1) // 64) * 64)
    meta.update(pair=pair.name, prompts=f"{len(prompts)} random token-id prompts of {lengths[0]}-{lengths[1]} "
                f"tokens (seed {a.seed})", engine_settings=settings.__dict__)
    bandwidth = copy_bandwidth(a.device)
    if bandwidth:
        mean_context = sum(map(len, prompts[:1])) + a.max_new_tokens // 2
        meta["traffic"] = step_traffic(pair.target, torch.finfo(getattr(torch, dtype)).bits // 8, mean_context,
                                       bandwidth).to_json()
    with ExitStack() as stack:
        services = None
        if "gateway" in parts:
            services = Services(pair, a.device, dtype, settings, work)
            stack.callback(services.stop)
            services.start_verifier()  # loads while the in-process engines do
        engines = None
        if parts & {"inprocess", "gateway"}:
            with state.phase("in-process engines"):
                engines = load_engines(pair, a.device, dtype, settings)
                stack.callback(engines.close)
            if services is not None:   # its start-up cost profile must not share the GPU with the reference pass
                services.wait_ready()
            with state.phase("reference pass"):
                traces, _ = run_inprocess(engines, prompts, ref_len, CONFIGS["off"])
                reference = work / "reference.json"
                ControlledAcceptance.write_references(reference, [(p, t.tokens) for p, t in zip(prompts, traces)])
            state.reference = [t.tokens[: a.max_new_tokens] for t in traces]
        if services is not None:
            with state.phase("services start"):
                for acc in plan.acceptances or [None]:   # one at a time: each drafter profiles on an idle GPU
                    services.add_gateway(acc, reference if acc is not None else None, a.seed)
                    services.wait_ready()
        if "inprocess" in parts:
            with state.phase("in-process cells"):
                _inprocess_cells(engines, plan, prompts, pair, a, reference, state)
        if services is not None:
            with state.phase("gateway cells"):
                _gateway_cells(services, plan.cells, prompts, pair, a.max_new_tokens, 2, state)
    del engines
    gc.collect()
    if a.device == "cuda":
        torch.cuda.empty_cache()  # room for the HF models
    if "hf" in parts:
        with state.phase("hf baselines"):
            _hf(pair, prompts[0], a, dtype, state)


def _inprocess_cells(engines, plan: Plan, prompts, pair: ModelPair, a, reference: Path, state: SuiteState) -> None:
    from benchmarks.inprocess import run_inprocess
    from specdec.config import ControlledAcceptance

    warmed: set[tuple[str, int]] = set()
    for cell in plan.cells:
        if cell.config.mode == "auto":   # the policy lives in the gateway
            continue
        control = engines.drafter.control
        if cell.acceptance is not None and (control is None or control.acceptance != cell.acceptance):
            engines.drafter.control = ControlledAcceptance.from_file(reference, cell.acceptance, a.seed)
        wave = prompts[: cell.concurrency]
        if (cell.config.name, cell.concurrency) not in warmed:  # allocations and first steps of this shape
            warmed.add((cell.config.name, cell.concurrency))
            run_inprocess(engines, wave, 2, cell.config)
        traces, timing = run_inprocess(engines, wave, a.max_new_tokens, cell.config)
        draft_ms, verify_ms = timing.means_ms()
        state.record(summarize(traces, "in-process", pair.name, cell.config.name, cell.concurrency, cell.acceptance,
                               draft_ms=draft_ms, verify_ms=verify_ms))


def _gateway_cells(services, cells: tuple[Cell, ...], prompts, pair: ModelPair, max_new: int, warm: int,
                   state: SuiteState, waves: int = 1, per_client: int = 1) -> None:
    """Each cell: `waves` measured waves (each after a warm-up wave of `warm` tokens); the row is
    the wave of median tokens per second (one wave of a few steps varies by several percent), with
    the gateway's step split over that wave (benchmarks/step_split.py). A wave is C clients each
    sending `per_client` requests back to back (1: C requests started together), over the first
    C * per_client prompts. The cells of one C take their waves in turn (`rotation`)."""
    from benchmarks import step_split
    from benchmarks.gateway_runs import GatewayClient

    client = GatewayClient()
    default = next(iter(services.gateways.values()))  # mode off: any gateway (its drafter idles)

    def wave(cell: Cell) -> RunResult:
        address = services.gateways.get(cell.acceptance, default)
        metrics = services.metrics[address]
        marks: dict[str, step_split.Snapshot] = {}
        traces = client.run(address, prompts[: cell.concurrency * per_client], max_new, cell.config,
                            warmup_tokens=warm, clients=cell.concurrency,
                            measuring=lambda: marks.update(before=step_split.scrape(metrics)))
        return summarize(traces, "gateway", pair.name, cell.config.name, cell.concurrency,
                         cell.acceptance, **step_split.split(marks["before"], step_split.scrape(metrics)))

    try:
        for group in rotation(cells):
            rows: dict[Cell, list[RunResult]] = {cell: [] for cell in group}
            for cell in group * waves:   # wave 1 of every cell, then wave 2, ...
                rows[cell].append(wave(cell))
            for cell in group:   # mode off first, as the cells came (speedups are against it)
                row = sorted(rows[cell], key=lambda r: r.tok_s)[len(rows[cell]) // 2]
                row.wave_tok_s = [r.tok_s for r in rows[cell]]
                state.record(row)
    except Exception:
        for name in services.procs:
            print(services.log_tail(name, 10), file=sys.stderr)
        raise
    finally:
        client.close()


def rotation(cells: tuple[Cell, ...]) -> list[list[Cell]]:
    """The cells grouped by concurrency, in order of first appearance. A group's waves run in turn
    (wave 1 of every cell, then wave 2, ...): the machine's speed drifts by more than the 3% that
    auto's aims allow, and a drift must fall on every mode alike, not on whichever rows ran last."""
    groups: dict[int, list[Cell]] = {}
    for cell in cells:
        groups.setdefault(cell.concurrency, []).append(cell)
    return list(groups.values())


def _hf(pair: ModelPair, prompt: list[int], a, dtype: str, state: SuiteState) -> None:
    from benchmarks.hf_baselines import run_hf

    for row in run_hf(pair, [prompt], a.max_new_tokens, a.device, dtype):
        off = next((r for r in state.rows if r.pair == pair.name and r.config == "off" and r.concurrency == 1), None)
        if off is not None:
            row.same_as_off = float(row.outputs[0] == off.outputs[0])
        state.record(row)


def smollm2_pair(state: SuiteState) -> ModelPair | None:
    """The embedded pair, or None (said, and recorded in the metadata) where it cannot be built."""
    with state.phase("smollm2 models"):
        pair, why = embedded_pair()
    if pair is None:
        state.meta["smollm2_skipped"] = f"the embedded SmolLM2 pair could not be built here ({why})"
        print(f"SmolLM2 part skipped: {why}", file=sys.stderr, flush=True)
    return pair


def _smollm2_part(a, plan: Plan, work: Path, state: SuiteState) -> None:
    from benchmarks.gateway_runs import Services
    from benchmarks.models import chat_prompts

    pair = smollm2_pair(state)
    if pair is None:
        return
    most = max(c.concurrency for c in plan.smollm2)
    prompts = chat_prompts(pair.target, most)
    settings = EngineSettings(max_sequences=most, cuda_graphs=a.device == "cuda", max_context=512)
    sm_dtype = "bfloat16" if a.device == "cuda" else "float32"  # float64 is for tiny exactness only
    (work / "smollm2").mkdir(exist_ok=True)
    services = Services(pair, a.device, a.dtype or sm_dtype, settings, work / "smollm2")
    try:
        with state.phase("smollm2 services start"):
            services.start_verifier()
            services.add_gateway(None)
            services.wait_ready()
        with state.phase("smollm2 cells"):
            _gateway_cells(services, plan.smollm2, prompts, pair, a.max_new_tokens, 2, state)
    finally:
        services.stop()
    with state.phase("smollm2 hf baselines"):
        _hf(pair, prompts[0], a, a.dtype or sm_dtype, state)


if __name__ == "__main__":
    main()
