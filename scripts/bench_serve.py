"""Benchmark the running system end to end through the gateway, mode off as the same-run baseline.

Starts verifier, drafter and gateway (the real processes), sends the same prompts in every
configuration at each concurrency, checks that every mode produced the same tokens as mode off
(lossless), and prints one table row per configuration:
output tok/s, time per output token p50/p99, time to first token p50, mean accepted length,
overlap hit rate, and speedup vs off at the same concurrency. A second table splits each row's
gateway steps (from the gateway's /metrics, benchmarks/step_split.py): the engines' times, the
transport, the gateway's own share, and the drafter's round trips.

    python scripts/bench_serve.py --device cuda --concurrency 1 4 16 --max-new-tokens 128
    python scripts/bench_serve.py --target DIR --draft DIR ...   (default: the embedded SmolLM2 pair)
    python scripts/bench_serve.py --eagle3-head DIR --prompts heldout   (an EAGLE-3 drafter; prompts
        from the held-out split of `specdec train-drafter`'s prompt set, never trained on)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from benchmarks import step_split  # noqa: E402
from cluster import Cluster, free_port, request  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a CPU cache is.",
    "List three uses of Python.",
    "What is the capital of France? Answer in one sentence.",
    "Give me a recipe for pancakes.",
    "Describe the water cycle for a ten-year-old.",
    "Write a haiku about autumn leaves.",
    "Summarize the plot of Romeo and Juliet.",
]
CONFIGS = {
    "off": ("off", {}),
    "chain k=2": ("chain", {"k": 2}),
    "chain k=4": ("chain", {"k": 4}),
    "chain k=6": ("chain", {"k": 6}),
    "chain k=4 no-overlap": ("chain", {"k": 4, "overlap": False}),
    "tree topk=2": ("tree", {"topk": 2, "depth": 4, "budget": 8}),
    "tree topk=4": ("tree", {"topk": 4, "depth": 5, "budget": 16}),
    "auto": ("auto", {}),   # the server picks per step (README "--mode auto")
}


def config(name: str) -> tuple[str, dict]:
    """A named config above, or any shape spelled the same way: "chain k=3", "chain k=3 no-overlap",
    "tree topk=8 depth=6 budget=32" (a tree's unnamed sizes as in "tree topk=4")."""
    if name in CONFIGS:
        return CONFIGS[name]
    mode, *words = name.split()
    if mode not in ("chain", "tree") or not words:
        raise argparse.ArgumentTypeError(f"unknown config {name!r}: use one of {list(CONFIGS)} or e.g. "
                                         f"'chain k=3', 'tree topk=8 depth=6 budget=32'")
    spec = dict(CONFIGS["chain k=4" if mode == "chain" else "tree topk=4"][1])
    for word in words:
        if word == "no-overlap" and mode == "chain":
            spec["overlap"] = False
            continue
        key, _, value = word.partition("=")
        if key not in spec or not value.isdigit():
            raise argparse.ArgumentTypeError(f"config {name!r}: {word!r} is not one of {mode}'s sizes {sorted(spec)}")
        spec[key] = int(value)
    return mode, spec


def one(cluster: Cluster, prompt_ids: list[int], n: int, mode: str, spec: dict, stop_at_eos: bool) -> dict:
    t0 = time.perf_counter()
    stamps, ids, final = [], [], None
    for msg in cluster.gateway.Generate(request(prompt_ids, n, mode, stop_at_eos=stop_at_eos, **spec), timeout=600):
        if msg.token_ids:
            stamps.append(time.perf_counter())
            ids += msg.token_ids
        if msg.HasField("final"):
            final = msg.final
    end = time.perf_counter()
    return {"ids": ids, "ttft": stamps[0] - t0, "tpot": (end - stamps[0]) / max(1, len(ids) - 1),
            "end": end, "start": t0, "stats": final.stats}


def run_config(cluster, prompts, n, mode, spec, concurrency, stop_at_eos: bool = False,
               metrics: str | None = None) -> dict:
    jobs = [prompts[i % len(prompts)] for i in range(max(concurrency, len(prompts)))]
    before = step_split.scrape(metrics) if metrics else None
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one(cluster, p, n, mode, spec, stop_at_eos), jobs))
    split = step_split.split(before, step_split.scrape(metrics)) if metrics else {}
    wall = max(r["end"] for r in results) - min(r["start"] for r in results)
    tokens = sum(len(r["ids"]) for r in results)
    tpots = sorted(r["tpot"] for r in results)
    steps = sum(r["stats"].steps for r in results)
    committed = sum(r["stats"].mean_accepted_length * r["stats"].steps for r in results)
    hits = sum(r["stats"].overlap_hits for r in results)
    misses = sum(r["stats"].overlap_misses for r in results)
    return {
        "tok_s": tokens / wall,
        "tpot_p50_ms": 1e3 * statistics.median(tpots),
        "tpot_p99_ms": 1e3 * tpots[min(len(tpots) - 1, int(0.99 * len(tpots)))],
        "ttft_p50_ms": 1e3 * statistics.median(r["ttft"] for r in results),
        "accept_len": committed / steps if steps else 1.0,
        "overlap_hit": hits / (hits + misses) if hits + misses else None,
        "outputs": [r["ids"] for r in results],
        "split": split,
    }


def hf_baselines(a, target: Path, prompts: list[list[int]], dtype: str) -> list:
    """HF generate and assisted generation with the draft model (never the EAGLE-3 head: HF has no such mode)."""
    from benchmarks.hf_baselines import run_hf
    from benchmarks.models import ModelPair

    if a.draft:
        draft = Path(a.draft)
    else:
        from specdec.embedded_model import ensure_embedded_models

        draft = ensure_embedded_models()[1]
    return run_hf(ModelPair("hf", target, draft, False), prompts, a.max_new_tokens, a.device, dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS),
                   help=f"{list(CONFIGS)} or any chain or tree spelled the same way, e.g. 'tree topk=8 depth=6 budget=32'")
    p.add_argument("--eagle3-head", default=None, help="draft with this EAGLE-3 head instead of --draft")
    p.add_argument("--project-hidden-states", action=argparse.BooleanOptionalAction, default=True,
                   help="with --eagle3-head: the verifier applies the head's fc to the rows it sends (as "
                        "`specdec serve` does)")
    p.add_argument("--prompts", default="fixed", choices=["fixed", "heldout"],
                   help="fixed: the 8 prompts above; heldout: the first --num-prompts held-out training prompts")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--hf", action="store_true",
                   help="also Hugging Face generate and assisted generation (k = 4, the --draft model, default the "
                        "derived SmolLM2 drafter) over the same prompts one at a time, in the same run")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="end each answer at EOS, as a chat client does (default: exactly --max-new-tokens "
                        "each; past EOS the text is out of any draft head's training, so acceptance drops)")
    p.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="on cpu: torch threads of each engine (0: torch's default, every core; default: the "
                        "shares `specdec serve` gives its verifier and drafter)")
    p.add_argument("--hedge-predrafts", action="store_true",
                   help="start the (EAGLE-3) drafter with --hedge-predrafts: overlap pre-drafts also for each "
                        "earlier rejection")
    p.add_argument("--json-out", default=None)
    p.add_argument("--log-dir", default=None, help="keep the services' logs here (SPECDEC_LOG_LEVEL=debug adds auto's "
                                                   "choices, expected and measured step times)")
    a = p.parse_args()
    for name in a.configs:
        try:
            config(name)
        except argparse.ArgumentTypeError as exc:
            p.error(str(exc))
    if a.stop_at_eos and a.hf:
        p.error("--hf generates fixed-length answers; run it without --stop-at-eos")
    if a.target:
        target, draft = Path(a.target), Path(a.draft or a.target)
    else:
        from specdec.embedded_model import ensure_embedded_models

        target, draft = ensure_embedded_models()
    drafter_extra, verifier_extra = [], []
    if a.eagle3_head:
        from specdec.launcher import eagle3_flags

        draft = target   # the drafter reads the target checkpoint's embeddings
        verifier_extra, drafter_extra = eagle3_flags(Path(a.eagle3_head), target, a.project_hidden_states)
    texts = PROMPTS
    if a.prompts == "heldout":
        from specdec.train.prompts import build_prompts

        texts = build_prompts(seed=0).heldout[:a.num_prompts]
    dtype = a.dtype or ("bfloat16" if a.device == "cuda" else "float32")
    tok = AutoTokenizer.from_pretrained(target)
    if tok.chat_template:
        texts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                         tokenize=False) for t in texts]
        prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        prompts = [tok(t)["input_ids"] for t in texts]
    threads = [] if a.cpu_threads is None else ["--cpu-threads", str(a.cpu_threads)]
    metrics = f"127.0.0.1:{free_port()}"
    if a.log_dir:
        Path(a.log_dir).mkdir(parents=True, exist_ok=True)
    cluster = Cluster(target, draft, device=a.device, dtype=dtype, extra=["--max-sequences", "64"],
                      log_dir=Path(a.log_dir) if a.log_dir else None,
                      gateway_extra=["--metrics-listen", metrics],
                      drafter_extra=drafter_extra + threads + (["--hedge-predrafts"] if a.hedge_predrafts else []),
                      verifier_extra=verifier_extra + threads).start()
    rows = []
    try:
        for mode, spec in map(config, a.configs):  # warm-up: allocations, kernel compiles
            run_config(cluster, prompts, 16, mode, spec, max(a.concurrency))
        total = len(a.concurrency) * len(a.configs)
        with tqdm(total=total, desc="benchmark", file=sys.stderr) as bar:
            for c in a.concurrency:
                base = None
                for name in a.configs:
                    mode, spec = config(name)
                    r = run_config(cluster, prompts, a.max_new_tokens, mode, spec, c, a.stop_at_eos, metrics)
                    if name == "off":
                        base = r
                    elif base is not None:
                        r["lossless"] = r["outputs"] == base["outputs"]
                    r.update(config=name, concurrency=c, speedup=r["tok_s"] / base["tok_s"] if base else None)
                    rows.append(r)
                    bar.update()
    finally:
        cluster.stop()
    hf_rows = hf_baselines(a, target, prompts, dtype) if a.hf else []
    print(f"\ntarget={target.name} draft={a.eagle3_head or draft.name} prompts={a.prompts} device={a.device} dtype={dtype} "
          f"max_new_tokens={a.max_new_tokens} stop_at_eos={a.stop_at_eos} cpu_threads={a.cpu_threads} "
          f"hedge_predrafts={a.hedge_predrafts}")
    print("| C | config | tok/s | TPOT p50 ms | TPOT p99 ms | TTFT p50 ms | accept len | overlap hit | vs off | same tokens as off |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        hit = "-" if r["overlap_hit"] is None else f"{r['overlap_hit']:.2f}"
        spd = "-" if r["speedup"] is None else f"{r['speedup']:.2f}x"
        print(f"| {r['concurrency']} | {r['config']} | {r['tok_s']:.1f} | {r['tpot_p50_ms']:.1f} | "
              f"{r['tpot_p99_ms']:.1f} | {r['ttft_p50_ms']:.1f} | {r['accept_len']:.2f} | {hit} | {spd} | "
              f"{r.get('lossless', '-')} |")
    print("\nPer gateway step, ms (a step serves the whole batch): the step, the verifier's and the synchronous "
          "drafts' engine times, transport (round trips less engine time), the gateway's own share (the step "
          "less its waits), the drafter's round trip before the verify, overlap's pre-draft beside it and what "
          "a step waited for it after the verdict")
    print("| C | config | step | verify engine | draft engine | transport | gateway | draft round trip | pre-draft | "
          "waited for it |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s = r["split"]
        if s:
            print(f"| {r['concurrency']} | {r['config']} | " + " | ".join(f"{s[k]:.2f}" for k in (
                "loop_step_ms", "verify_ms", "draft_engine_ms", "transport_ms", "gateway_ms", "draft_ms",
                "predraft_ms", "predraft_exposed_ms")) + " |")
    if hf_rows:
        base = hf_rows[0].tok_s
        print("\n| Hugging Face, C = 1 | tok/s | TPOT p50 ms | vs hf generate | same tokens as our off |")
        print("|---|---|---|---|---|")
        ours = next(r for r in rows if r["config"] == "off" and r["concurrency"] == 1)
        for r in hf_rows:
            print(f"| {r.config} | {r.tok_s:.1f} | {r.tpot_p50_ms:.1f} | {r.tok_s / base:.2f}x | "
                  f"{r.outputs == ours['outputs']} |")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in rows], indent=1))


if __name__ == "__main__":
    main()
