"""The report: markdown tables and PNG figures from a run's rows, written into BENCHMARKS.md
between marker comments (the section is replaced, the rest of the file kept).

    python -m benchmarks.report OUT_DIR [MORE_DIRS ...] [--report BENCHMARKS.md] [--rebuild]

installs a finished run's section and figures (e.g. brought back from the GPU machine);
--rebuild renders them again from OUT_DIR/results.json first (a run cut short leaves its rows
there), and several directories are merged (runs of different --parts), into --render-dir. Plots
need matplotlib (the `bench` extra); without it the section says so and keeps its tables.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from benchmarks import analysis as an
from benchmarks.metrics import RunResult, expected_accept_len
from benchmarks.roofline import COPY_BYTES

BEGIN = "<!-- benchmarks:begin: written by `python -m benchmarks.run`; edits between these markers are replaced -->"
END = "<!-- benchmarks:end -->"
FIGURES = "benchmarks/figures"   # relative to the report file
SHARED_GPU = ("Drafter and verifier share the one GPU (in-process: two threads of one process; through "
              "the gateway: two processes), so draft and verify forwards take turns on it: overlap hides "
              "host work, not GPU time.")


def _f(x, fmt: str = "{:.1f}", none: str = "-") -> str:
    return none if x is None else fmt.format(x)


def _paths_row(rows, r_in: RunResult | None, r_gw: RunResult | None) -> list[str]:
    cells = []
    for r in (r_in, r_gw):
        cells += ([_f(r.tok_s), f"{r.tpot_p50_ms:.1f} / {r.tpot_p99_ms:.1f}", _f(r.accept_len, "{:.2f}"),
                   _f(r.speedup, "{:.2f}x")] if r else ["-"] * 4)
    same = [_f(r.same_as_off, "{:.2f}") for r in (r_in, r_gw) if r is not None]
    return cells + [_f(an.gateway_share(rows, r_gw) if r_gw else None, "{:.0%}"), " / ".join(same) or "-"]


PATHS_HEAD = ("| in-process tok/s | TPOT p50 / p99 ms | accept len | vs off | gateway tok/s | TPOT p50 / p99 ms "
              "| accept len | vs off | gateway share of step | same tokens as off (in / gw) |")


def _table(head: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in body])


def paths_table(rows: list[RunResult], keys: list[tuple[float | None, int, str]]) -> str:
    head = ["a", "C", "config", "expected accept len", *[h.strip() for h in PATHS_HEAD.strip("|").split("|")]]
    body = []
    for a, c, cfg in keys:
        r_in, r_gw = an.find(rows, an.IN, cfg, c, a), an.find(rows, an.GW, cfg, c, a)
        depth = r_in.draft_depth if r_in is not None else None
        expected = None if a is None or depth is None else expected_accept_len(a, depth)
        body.append([_f(a, "{:g}"), str(c), cfg, _f(expected, "{:.2f}"), *_paths_row(rows, r_in, r_gw)])
    return _table(head, body)


def headline_keys(rows: list[RunResult], a: float) -> list[tuple]:
    keys = {(None if r.config == "off" else a, r.concurrency, r.config) for r in rows
            if r.path in (an.IN, an.GW) and (r.acceptance == a or r.config == "off") and r.pair == rows[0].pair}
    return sorted(keys, key=lambda k: (k[1], an.config_order(k[2])))


def sweep_keys(rows: list[RunResult]) -> list[tuple]:
    spec = [r for r in rows if r.path in (an.IN, an.GW) and r.acceptance is not None]
    seen: dict[tuple, set] = {}
    for r in spec:
        seen.setdefault((r.concurrency, r.config), set()).add(r.acceptance)
    keys = {(r.acceptance, r.concurrency, r.config) for r in spec if len(seen[(r.concurrency, r.config)]) > 1}
    return sorted(keys, key=lambda k: (k[1], an.config_order(k[2]), k[0]))


def simple_table(rows: list[RunResult], with_pair: bool = False) -> str:
    head = ["pair"] * with_pair + ["path", "C", "config", "tok/s", "TPOT p50 ms", "TPOT p99 ms", "TTFT p50 ms",
                                   "accept len", "overlap hit", "vs off", "same tokens as off"]
    body = [[r.pair] * with_pair + [r.path, str(r.concurrency), r.config, _f(r.tok_s), _f(r.tpot_p50_ms),
             _f(r.tpot_p99_ms), _f(r.ttft_p50_ms), "-" if r.path == "hf" else _f(r.accept_len, "{:.2f}"),
             _f(r.overlap_hit, "{:.2f}"), _f(r.speedup, "{:.2f}x"), _f(r.same_as_off, "{:.2f}")] for r in rows]
    return _table(head, body)


def plots(rows: list[RunResult], meta: dict, out_dir: Path) -> list[str] | str:
    """The figures as PNGs in out_dir -> their file names, or why there are none."""
    try:
        from benchmarks import figures
    except ImportError as exc:
        return f"plots skipped ({exc}; `pip install -e '.[bench]'` adds matplotlib)"
    return figures.draw(rows, meta, out_dir)


def section(rows: list[RunResult], meta: dict, out_dir: Path) -> str:
    """The markdown between the markers; figures are drawn into out_dir."""
    pair = meta.get("pair", "random pair not run")
    main = [r for r in rows if r.pair == pair]
    figs = plots(main, meta, out_dir)

    def fig(name: str) -> str:
        drawn = isinstance(figs, list) and f"{name}.png" in figs
        return f"![{name}]({FIGURES}/{name}.png)\n\n" if drawn else ""

    a = an.headline(main)
    out = [BEGIN, f"## Benchmark suite: {pair}, controlled acceptance", "",
           f"{meta['date']}, {meta['machine']}, torch {meta['torch']}, triton {meta.get('triton') or '-'}, "
           f"{meta['dtype']}. {meta.get('prompts', 'Chat prompts')}; {meta['max_new_tokens']} new tokens per "
           "sequence, greedy; one wave of C sequences per row, started together. Every number below comes "
           "from this one run, mode off included (the same-run baseline: \"vs off\" is tok/s over mode off "
           "at the same C on the same path).", "", "```", meta["command"], "```", "", f"**{SHARED_GPU}**", "",
           "Weights are random (a step's cost does not depend on them) but for a planted LM head "
           "(`benchmarks/models.py` planted_head: scaled-up embeddings, the head their table shifted by one "
           "row): the target's greedy next token is the last token + 1 by a margin far beyond bf16 rounding, "
           "so batch shapes and modes do not change its tokens (the same-tokens columns check it) and the "
           "reference stays valid; the draft (tied head) is as confident, so EAGLE trees reach their depth. "
           "Acceptance `a` is set by the controlled-acceptance drafter (`drafter_svc/controlled.py`): the draft "
           "model runs its real forwards, then each position on the draft's main path (a chain; a tree's path to "
           "its first deepest node) proposes the target's own next token (from a first mode-off pass) with "
           "probability a, so a step accepts a path prefix of expected length a + a^2 + ... TPOT p50 / p99 is "
           "over the sequences of a row (at C = 1 there is one). \"Expected accept len\" is (1 - a^(D+1)) / "
           "(1 - a) for the mean path depth D of the in-process drafts (a chain's k; a tree's deepest "
           "node). \"Gateway share of step\" is 1 - in-process step time / gateway step time "
           "for the same cell.", ""]
    agree = meta.get("reference_same_as_off")
    if agree:
        worst = min(agree.values())
        each = ", ".join(f"{k}: {v:.2f}" for k, v in agree.items())
        out += [f"The reference pass (mode off, all prompts in one batch) and the mode off rows produced the same "
                f"tokens for {worst:.0%} of sequences at worst ({each})"
                + ("." if worst == 1 else "; where they differ, rounding flipped a greedy argmax between batch "
                   "shapes, and that sequence's acceptance is below a from there on."), ""]
    if isinstance(figs, str):
        out += [f"({figs})", ""]
    if a is not None:
        out += [f"### Modes x concurrency, a = {a:g}", "", fig("throughput") + fig("gateway_share")
                + paths_table(main, headline_keys(main, a)), ""]
    sweep = sweep_keys(main)
    if sweep:
        out += ["### Acceptance sweep", "", fig("acceptance") + paths_table(main, sweep), ""]
    ideal = an.ideal_rows(main, a)
    if ideal:
        cr = an.cost_ratio(main, a)
        out += [f"### Against the analytic ideal, a = {a:g}, k = {an.IDEAL_K}, C = 1", "",
                f"c = draft cost per token / target step = {cr['draft_token_ms']:.2f} ms / "
                f"{cr['target_step_ms']:.2f} ms = {cr['c']:.3f} (in-process: the drafter call before each "
                f"verify step of chain k={an.IDEAL_K} no-overlap, over k; mode off's step). Ideal "
                "(1 - a^(k+1)) / ((1 - a)(1 + k c)).", "",
                _table(["path", "config", "accept len", "measured speedup", "ideal", "measured / ideal"],
                       [[d["path"], d["config"], f"{d['accept_len']:.2f}", f"{d['speedup']:.2f}x",
                         f"{d['ideal']:.2f}x", f"{d['ratio']:.2f}"] for d in ideal]), ""]
    roof = an.roofline_rows(main, meta.get("traffic"), pair)
    if roof:
        t = meta["traffic"]
        out += ["### Mode off at batch 1 against the memory-traffic limit", "",
                f"A step reads {t['weight_bytes'] / 1e9:.2f} GB of weights and {t['kv_bytes'] / 1e6:.1f} MB of KV "
                f"(mean context); a {COPY_BYTES >> 30} GiB device copy measured {t['bandwidth'] / 1e12:.2f} TB/s "
                f"(read + write), so the limit is {t['limit_ms']:.2f} ms a step.", "",
                _table(["path", "step ms", "limit ms", "limit / step"],
                       [[d["path"], f"{d['step_ms']:.2f}", f"{d['limit_ms']:.2f}", f"{d['fraction']:.0%}"]
                        for d in roof]), ""]
    hf = [r for r in rows if r.path == "hf"]
    if hf:
        out += ["### Hugging Face baselines (batch 1, same run)", "",
                "`generate` (greedy) and assisted generation with the draft model as assistant (4 tokens a "
                "round). The random pair's assistant has no acceptance control: its own drafts repeat the last "
                "token, which the target never accepts (a = 0); mode off at C = 1 of each path is listed beside them.", "",
                simple_table(hf + [r for r in rows if r.config == "off" and r.concurrency == 1
                                   and r.path in (an.IN, an.GW)], with_pair=True), ""]
    small = [r for r in rows if r.pair != pair and r.path != "hf"]
    if small or meta.get("smollm2_skipped"):
        out += [f"### {small[0].pair if small else 'SmolLM2 pair'}: real acceptance, through the gateway", ""]
        out += [simple_table(small), ""] if small else [f"Skipped: {meta['smollm2_skipped']}", ""]
    out.append(END)
    return "\n".join(out) + "\n"


def install(out_dir: Path, report: Path, begin: str = BEGIN, end: str = END) -> None:
    """Copy the run's figures next to the report and put its section between the markers."""
    figures = report.parent / FIGURES
    pngs = sorted(out_dir.glob("*.png"))
    if pngs:
        figures.mkdir(parents=True, exist_ok=True)
        for png in pngs:
            shutil.copy2(png, figures / png.name)
    text = report.read_text() if report.exists() else "# Benchmarks\n"
    new = (out_dir / "section.md").read_text().strip()
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + new + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + new + "\n"
    report.write_text(text)


def load(out_dirs: list[Path]) -> tuple[list[RunResult], dict]:
    """Rows of every directory; the first one's metadata, completed by the others'."""
    rows, meta = [], {}
    for d in out_dirs:
        data = json.loads((d / "results.json").read_text())
        rows += [RunResult(**r) for r in data["rows"]]
        timings = {**data["meta"].get("timings", {}), **meta.get("timings", {})}
        meta = {**data["meta"], **meta, "timings": timings}
    return rows, meta


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dirs", type=Path, nargs="+")
    p.add_argument("--report", type=Path, default=Path(__file__).resolve().parents[1] / "BENCHMARKS.md")
    p.add_argument("--rebuild", action="store_true", help="render the section and figures again from results.json")
    p.add_argument("--render-dir", type=Path, default=Path(__file__).resolve().parent / "out",
                   help="where --rebuild (or a merge) writes the section and figures (the inputs may be read-only)")
    a = p.parse_args()
    source = a.out_dirs[0]
    if a.rebuild or len(a.out_dirs) > 1:
        rows, meta = load(a.out_dirs)
        source = a.render_dir
        source.mkdir(parents=True, exist_ok=True)
        for stale in source.glob("*.png"):
            stale.unlink()
        (source / "section.md").write_text(section(rows, meta, source))
    install(source, a.report)
    print(f"installed {source / 'section.md'} into {a.report}")


if __name__ == "__main__":
    main()
