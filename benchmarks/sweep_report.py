"""The concurrency sweep's report: per pair and acceptance, tok/s and TPOT p50/p99 against C (one line
per mode, PNG) and a table of auto against mode off and the best fixed mode, with the aims checked.
Written into BENCHMARKS.md between its own markers (benchmarks/report.py's install).

    python -m benchmarks.sweep_report OUT_DIR [MORE_DIRS ...] [--report BENCHMARKS.md]

renders the section again from results.json (several runs, e.g. brought back from the GPU machine in
parts, each compared with its own mode off) into --render-dir and installs it."""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path

from benchmarks.metrics import RunResult
from benchmarks.report import FIGURES, _f, _table
from benchmarks.report import install as install_between
from benchmarks.report import load

BEGIN = "<!-- sweep:begin: written by `python -m benchmarks.sweep`; edits between these markers are replaced -->"
END = "<!-- sweep:end -->"
AIM_SHORTFALL = 0.97       # auto >= 97% of the best fixed mode and of mode off, everywhere


def groups(rows: list[RunResult]) -> list[tuple[str, float | None, list[RunResult]]]:
    """(pair, acceptance, rows) per line-up; mode off (acceptance None) belongs to every a of its pair."""
    out = []
    for pair in dict.fromkeys(r.pair for r in rows):
        mine = [r for r in rows if r.pair == pair]
        accs = sorted({r.acceptance for r in mine if r.acceptance is not None}) or [None]
        for a in accs:
            out.append((pair, a, [r for r in mine if r.acceptance == a or r.config == "off"]))
    return out


def comparison(rows: list[RunResult]) -> list[dict]:
    """Per C: auto's tok/s against mode off and against the best fixed mode."""
    out = []
    for c in sorted({r.concurrency for r in rows}):
        at = {r.config: r for r in rows if r.concurrency == c}
        auto, off = at.get("auto"), at.get("off")
        fixed = [r for name, r in at.items() if name != "auto"]
        if auto is None or off is None or not fixed:
            continue
        best = max(fixed, key=lambda r: r.tok_s)
        out.append({"C": c, "rows": at, "auto": auto.tok_s, "off": off.tok_s, "best": best.tok_s,
                    "best_name": best.config, "vs_off": paired(auto, off), "vs_best": paired(auto, best),
                    "waves_vs_best": per_wave(auto, best)})
    return out


def per_wave(a: RunResult, b: RunResult) -> list[float]:
    """a's tok/s over b's, wave by wave, where both took the same waves in turn (else nothing)."""
    if a.wave_tok_s and len(a.wave_tok_s) == len(b.wave_tok_s):
        return [x / y for x, y in zip(a.wave_tok_s, b.wave_tok_s)]
    return []


def paired(a: RunResult, b: RunResult) -> float:
    """a against b: the median of their waves' ratios (wave i of each ran side by side, so a slow
    spell of the machine falls on both; on the H100 one mode's waves at C = 32 varied by 37% in
    one run, and the ratio of each row's median wave read 0.87 where the waves' ratios were 0.79,
    1.16 and 0.96), else the ratio of their rows."""
    ratios = per_wave(a, b)
    return statistics.median(ratios) if ratios else a.tok_s / b.tok_s


def overlap_rows(rows: list[RunResult]) -> list[list[str]]:
    """Per C where chain k=4 ran with and without overlap: the share of drafter time overlap hid,
    its hit rate, what a step still waited for the pre-draft, and the speedup overlap gave."""
    out = []
    for c in sorted({r.concurrency for r in rows}):
        at = {r.config: r for r in rows if r.concurrency == c}
        on, seq = at.get("chain k=4"), at.get("chain k=4 no-overlap")
        if on is None or seq is None or on.overlap_hidden is None:
            continue
        out.append([str(c), f"{on.overlap_hidden:.0%}", _f(on.overlap_hit, "{:.2f}"),
                    _f(on.predraft_ms, "{:.2f}"), _f(on.predraft_exposed_ms, "{:.2f}"), _f(seq.draft_ms, "{:.2f}"),
                    f"{on.tok_s / seq.tok_s:.2f}x"])
    return out


def _figure(pair: str, a: float | None, rows: list[RunResult], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for cfg in dict.fromkeys(r.config for r in rows):
        pts = sorted((r.concurrency, r.tok_s, r.tpot_p50_ms, r.tpot_p99_ms) for r in rows if r.config == cfg)
        cs = [p[0] for p in pts]
        style = {"color": "black", "linewidth": 2.5} if cfg == "off" else (
            {"color": "red", "linewidth": 2} if cfg == "auto" else {"marker": "o", "markersize": 3})
        (line,) = left.plot(cs, [p[1] for p in pts], label=cfg, **style)
        right.plot(cs, [p[2] for p in pts], color=line.get_color(), label=f"{cfg} p50")
        right.plot(cs, [p[3] for p in pts], color=line.get_color(), linestyle=":", label=f"{cfg} p99")
    for ax, ylabel in ((left, "output tok/s"), (right, "TPOT ms (p50 solid, p99 dotted)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrency C")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
    left.legend(fontsize=7)
    what = "real acceptance" if a is None else f"a = {a:g}"
    fig.suptitle(f"{pair}, {what} ({meta['gpu']}; {_placement(meta)})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _placement(meta: dict) -> str:
    """Where the engines ran (runs before the sweep recorded it shared one GPU), and whether the
    drafters hedged their pre-drafts."""
    return meta.get("placement", "drafter and verifier share it") + (
        ", hedged pre-drafts" if meta.get("hedge_predrafts") else "")


def _name(pair: str, a: float | None) -> str:
    tag = "".join(ch if ch.isalnum() else "_" for ch in pair.lower()).strip("_")[:24]
    return f"sweep_{tag}_{'real' if a is None else f'a{a:g}'}".replace(".", "")


def section(runs: list[tuple[list[RunResult], dict]], out_dir: Path) -> str:
    """runs: (rows, metadata) per sweep command, e.g. the random pair's acceptances split over
    device calls; each run's rows are compared with that run's own mode off."""
    meta = runs[0][1]
    waves, per_client = meta.get("waves", 1), meta.get("requests_per_client", 1)
    load = ("C sequences started together" if per_client == 1 else
            f"C clients each sending {per_client} requests, the next as soon as the last ended")
    out = [BEGIN, "## Concurrency sweep: every mode and `--mode auto`, through the gateway", "",
           f"{meta['date']}, {meta['machine']}, torch {meta['torch']}, {meta['dtype']}; {meta['max_new_tokens']} new "
           f"tokens per sequence, greedy; each row the median of {waves} wave{'s' * (waves > 1)} of {load}; "
           "every ratio against mode off of the same run, the median of the ratios of waves run side by side. "
           "Random pair: controlled acceptance a (benchmarks/run.py explains it); SmolLM2: its shipped EAGLE-3 "
           "head on held-out chat prompts. auto is one gateway per pair and a, so what it learned at one C "
           "carries to the next, as in a running server.",
           "", "```", *(m["command"] for _, m in runs), "```", ""]
    plots = importlib.util.find_spec("matplotlib") is not None
    if not plots:
        out += ["(plots skipped: `pip install -e '.[bench]'` adds matplotlib)", ""]
    worst_best, worst_off = [], []
    for pair, a, mine in [g for rows, _ in runs for g in groups(rows)]:
        name = _name(pair, a)
        out += [f"### {pair}, {'real acceptance' if a is None else f'a = {a:g}'}", ""]
        if plots:
            _figure(pair, a, mine, meta, out_dir / f"{name}.png")
            out += [f"![{name}]({FIGURES}/{name}.png)", ""]
        cmp = comparison(mine)
        configs = list(dict.fromkeys(r.config for r in mine))
        body = []
        for d in cmp:
            worst_best.append((d["vs_best"], pair, a, d["C"]))
            worst_off.append((d["vs_off"], pair, a, d["C"]))
            body.append([str(d["C"]), *[_f(d["rows"][c].tok_s) if c in d["rows"] else "-" for c in configs],
                         f"{d['rows']['auto'].tpot_p50_ms:.1f} / {d['rows']['auto'].tpot_p99_ms:.1f}",
                         f"{d['rows']['auto'].accept_len:.2f}", f"{d['vs_off']:.2f}x",
                         f"{d['vs_best']:.2f} ({d['best_name']})",
                         ", ".join(f"{v:.2f}" for v in d["waves_vs_best"]) or "-"])
        out += [_table(["C", *[f"{c} tok/s" for c in configs], "auto TPOT p50 / p99 ms", "auto accept len",
                        "auto / off", "auto / best fixed", "auto / best fixed, each wave"], body), ""]
        hidden = overlap_rows(mine)
        if hidden:
            out += [f"Overlap ({_placement(meta)}), chain k=4; per gateway "
                    "step, ms:", "",
                    _table(["C", "drafter time hidden", "pre-draft hit", "pre-draft", "waited for it after the verdict",
                            "draft without overlap", "overlap / no overlap"], hidden), ""]
    if worst_best:
        vb, vo = min(worst_best), min(worst_off)
        out += ["### Aims", "",
                f"- auto against the best fixed mode, worst point: {vb[0]:.2f} ({vb[1]}, a = {_f(vb[2], '{:g}')}, "
                f"C = {vb[3]}); aim >= {AIM_SHORTFALL:.2f}. Points below the aim: "
                f"{sum(v < AIM_SHORTFALL for v, *_ in worst_best)} of {len(worst_best)}.",
                f"- auto against mode off, worst point: {vo[0]:.2f} ({vo[1]}, a = {_f(vo[2], '{:g}')}, C = {vo[3]}); "
                f"aim >= {AIM_SHORTFALL:.2f}. Points below the aim: {sum(v < AIM_SHORTFALL for v, *_ in worst_off)}."]
        hidden = [r.overlap_hidden for rows, _ in runs for r in rows
                  if r.config == "chain k=4" and r.overlap_hidden is not None]
        if hidden:
            out.append(f"- Drafter time hidden by overlap (chain k=4, {_placement(meta)}): "
                       f"{min(hidden):.0%} to {max(hidden):.0%}; aim >= 80% with the drafter on a GPU of its own.")
        for c, aim in ((1, 2.0), (32, 1.1)):
            hit = [v for v, pair, a, cc in worst_off if a == 0.8 and cc == c]
            if hit:
                out.append(f"- a = 0.8, C = {c}: auto / off = {hit[0]:.2f}x; aim >= {aim:g}x.")
        out.append("")
    out.append(END)
    return "\n".join(out) + "\n"


def install(out_dir: Path, report: Path) -> None:
    install_between(out_dir, report, BEGIN, END)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dirs", type=Path, nargs="+")
    p.add_argument("--report", type=Path, default=Path(__file__).resolve().parents[1] / "BENCHMARKS.md")
    p.add_argument("--render-dir", type=Path, default=Path(__file__).resolve().parent / "out" / "sweep-render")
    a = p.parse_args()
    runs = [load([d]) for d in a.out_dirs]
    a.render_dir.mkdir(parents=True, exist_ok=True)
    for stale in a.render_dir.glob("*.png"):
        stale.unlink()
    (a.render_dir / "section.md").write_text(section(runs, a.render_dir))
    install(a.render_dir, a.report)
    print(f"installed {a.render_dir / 'section.md'} into {a.report}")


if __name__ == "__main__":
    main()
