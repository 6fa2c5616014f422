"""The concurrency sweep: every mode, `auto` included, at C = 1 ... 64 through the gateway.

The 8B-shaped random pair runs at controlled acceptance a = 0, 0.6, 0.8, 0.9 (one drafter and
gateway per a over one verifier, as in benchmarks/run.py; mode off once per C), and the SmolLM2 pair
with its shipped EAGLE-3 head at its real acceptance. Each row is the median of `--waves` waves of C
requests started together. One wave of 64 tokens lasts about a second on the H200 and varies by a
few percent run to run, more than the 3% the aims allow, so the rows of one C take their waves in
turn: the machine's drift falls on every mode alike. The report (benchmarks/sweep_report.py) plots
tok/s and TPOT p50/p99 against C, one line per mode, and tabulates auto against mode off and against
the best fixed mode.

    python -m benchmarks.sweep --device cuda --parts random     # about 12 minutes on one H200
    python -m benchmarks.sweep --device cuda --parts smollm2    # then: benchmarks.sweep_report DIR1 DIR2
    python -m benchmarks.sweep --device cpu --tiny --acceptance 0 0.8 --concurrency 1 4   # smoke
    python -m benchmarks.sweep --drafter-gpus 0 --verifier-gpus 1,2 --tp 2 ...   # disaggregated (compose's shape)
    python -m benchmarks.sweep --requests-per-client 4 ...   # closed loop: each client's next request at once

A wave ends with its slowest sequence: speculation ends its sequences at different steps, and the
last steps run a small batch at nearly a full step's cost, which mode off (every sequence ends at
the same step) never pays. A closed loop (`--requests-per-client`), as serving benchmarks measure
concurrency, pays that tail once per run instead of once per request.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from benchmarks import sweep_report
from benchmarks.grid import CONFIGS, _cells, _ordered
from benchmarks.models import REPO, EngineSettings, chat_prompts, random_pair, random_prompts, with_eagle3_head
from benchmarks.run import _gateway_cells, checkpoint_root, smollm2_pair, start_run
from benchmarks.suite_state import SuiteState

CONCURRENCY = (1, 2, 4, 8, 16, 32, 48, 64)
ACCEPTANCE = (0.0, 0.6, 0.8, 0.9)
MODES = ("off", "chain k=4", "chain k=4 no-overlap", "tree topk=4", "auto")
PARTS = ("random", "smollm2")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float64 for --tiny, else float32")
    p.add_argument("--tiny", action="store_true", help="tiny random shapes instead of 8B/1B (CPU runs, tests)")
    p.add_argument("--acceptance", type=float, nargs="+", default=list(ACCEPTANCE))
    p.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    p.add_argument("--modes", nargs="+", choices=list(CONFIGS), default=list(MODES))
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--fold-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help="start the verifier with --fold-prefill or --no-fold-prefill (prompt chunks ride in the "
                        "verify forward; default: the verifier's own)")
    p.add_argument("--eagle3-drafter", action="store_true",
                   help="random part: draft with a random EAGLE-3 head for the target instead of the 1B draft model "
                        "(its drafts rewritten to the same controlled acceptance)")
    p.add_argument("--project-hidden-states", action=argparse.BooleanOptionalAction, default=True,
                   help="EAGLE-3 pairs: the verifier applies the head's fc to the rows it sends (as `specdec serve` "
                        "does); --no-project-hidden-states sends the aux layers' states concatenated")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--waves", type=int, default=3, help="measured waves per row; the row is their median")
    p.add_argument("--requests-per-client", type=int, default=1,
                   help="each of a wave's C clients sends this many requests, the next as soon as the last ends "
                        "(a closed loop at concurrency C); 1: one request each, all started together")
    p.add_argument("--drafter-gpus", default=None, help="CUDA_VISIBLE_DEVICES of the drafters (default: shared)")
    p.add_argument("--verifier-gpus", default=None, help="CUDA_VISIBLE_DEVICES of the verifier (default: shared)")
    p.add_argument("--tp", type=int, default=1, help="the verifier's tensor-parallel ranks (--verifier-gpus)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=REPO / "benchmarks" / "out" / "sweep")
    p.add_argument("--report", type=Path, default=REPO / "BENCHMARKS.md")
    p.add_argument("--no-report", action="store_true", help="leave --report alone (the section is still in --out-dir)")
    p.add_argument("--ckpt-dir", type=Path, default=None, help="as benchmarks.run")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--hedge-predrafts", action="store_true",
                   help="start the drafters with --hedge-predrafts (an EAGLE-3 head's overlap pre-drafts also "
                        "cover each draft position's likeliest rejection)")
    p.add_argument("--work-dir", type=Path, default=None, help="service logs and the reference file")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    random_cells = _ordered(_cells(a.acceptance, a.concurrency, a.modes)) if "random" in a.parts else ()
    smol_cells = _ordered(_cells([None], a.concurrency, a.modes)) if "smollm2" in a.parts else ()
    dtype, work, meta = start_run(a, "benchmarks.sweep", argv)
    meta["placement"] = placement(a).describe()
    meta["hedge_predrafts"] = a.hedge_predrafts
    meta["waves"], meta["requests_per_client"] = a.waves, a.requests_per_client
    state = SuiteState(a.out_dir, meta, tqdm(total=len(random_cells) + len(smol_cells), desc="sweep rows",
                                             file=sys.stderr))
    try:
        if random_cells:
            _random_part(a, random_cells, dtype, work, state)
        if smol_cells:
            _smollm2_part(a, smol_cells, work, state)
    finally:
        state.bar.close()
        state.save()
        (a.out_dir / "section.md").write_text(sweep_report.section([(state.rows, meta)], a.out_dir))
    if not a.no_report:
        sweep_report.install(a.out_dir, a.report)
    print(f"\nresults: {a.out_dir / 'results.json'}; section: {a.out_dir / 'section.md'}", flush=True)
    return a.out_dir / "results.json"


def placement(a):
    from benchmarks.gateway_runs import Placement

    return Placement(a.drafter_gpus, a.verifier_gpus, a.tp)


def drafter_extra(a) -> tuple[str, ...]:
    return ("--hedge-predrafts",) if a.hedge_predrafts else ()


def verifier_extra(a) -> tuple[str, ...]:
    return () if a.fold_prefill is None else ("--fold-prefill" if a.fold_prefill else "--no-fold-prefill",)


def _random_part(a, cells, dtype: str, work: Path, state: SuiteState) -> None:
    from benchmarks.gateway_runs import Services
    from benchmarks.inprocess import load_engines, run_inprocess
    from specdec.config import ControlledAcceptance

    root, remove = checkpoint_root(a)
    most = max(c.concurrency for c in cells)
    lengths = (4, 12) if a.tiny else (32, 96)
    try:
        with state.phase("checkpoints"):
            pair = random_pair(root, a.tiny, a.device)
            if a.eagle3_drafter:
                pair = replace(with_eagle3_head(pair), project_hidden_states=a.project_hidden_states)
        prompts = random_prompts(most * a.requests_per_client, 512 if a.tiny else 128256, lengths, a.seed)
        ref_len = a.max_new_tokens + max(c.config.lookahead for c in cells)
        settings = EngineSettings(max_sequences=most, cuda_graphs=a.device == "cuda",
                                  max_context=-(-(lengths[1] + ref_len + 1) // 64) * 64)
        state.meta.update(pair=pair.name, prompts=f"{len(prompts)} random token-id prompts of {lengths[0]}-"
                          f"{lengths[1]} tokens (seed {a.seed})", engine_settings=settings.__dict__)
        with ExitStack() as stack:
            services = Services(pair, a.device, dtype, settings, work, placement(a), drafter_extra(a),
                                verifier_extra(a))
            stack.callback(services.stop)
            with state.phase("reference pass"):   # the target's own continuations, for the controlled drafters
                engines = load_engines(pair, a.device, dtype, settings)
                traces = [t for i in range(0, len(prompts), most)   # at most `most` sequences at a time
                          for t in run_inprocess(engines, prompts[i:i + most], ref_len, CONFIGS["off"])[0]]
                engines.close()
                del engines
                if a.device == "cuda":
                    torch.cuda.empty_cache()
                reference = work / "reference.json"
                ControlledAcceptance.write_references(reference, [(p, t.tokens) for p, t in zip(prompts, traces)])
            state.reference = [t.tokens[: a.max_new_tokens] for t in traces]
            with state.phase("services start"):   # one at a time: each profiles its steps on an idle GPU
                services.start_verifier()
                services.wait_ready()
                for acc in sorted({c.acceptance for c in cells if c.acceptance is not None}) or [None]:
                    services.add_gateway(acc, reference if acc is not None else None, a.seed)
                    services.wait_ready()
            with state.phase("rows"):
                _gateway_cells(services, cells, prompts, pair, a.max_new_tokens, 2, state, a.waves,
                               a.requests_per_client)
    finally:
        if remove:
            shutil.rmtree(root, ignore_errors=True)


def _smollm2_part(a, cells, work: Path, state: SuiteState) -> None:
    from benchmarks.gateway_runs import Services

    pair = smollm2_pair(state)
    if pair is None:
        return
    pair = replace(pair, project_hidden_states=a.project_hidden_states)
    most = max(c.concurrency for c in cells)
    prompts = chat_prompts(pair.target, most * a.requests_per_client, heldout=True)
    settings = EngineSettings(max_sequences=most, cuda_graphs=a.device == "cuda", max_context=1024)
    (work / "smollm2").mkdir(exist_ok=True)
    services = Services(pair, a.device, "bfloat16" if a.device == "cuda" else "float32", settings, work / "smollm2",
                        placement(a), drafter_extra(a), verifier_extra(a))
    try:
        with state.phase("smollm2 services start"):
            services.start_verifier()
            services.add_gateway(None)
            services.wait_ready()
        with state.phase("smollm2 rows"):
            _gateway_cells(services, cells, prompts, pair, a.max_new_tokens, 2, state, a.waves, a.requests_per_client)
    finally:
        services.stop()


if __name__ == "__main__":
    main()
