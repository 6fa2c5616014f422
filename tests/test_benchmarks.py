"""The benchmark suite end to end on tiny random models (CPU): in-process and through the gateway,
the controlled-acceptance drafter gives exactly the acceptance asked for at a = 0 (every first
draft token rejected) and a = 1 (every draft token accepted), every mode reproduces mode off's
tokens, and the report section lands between its markers."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not an installed package

from benchmarks import report, run  # noqa: E402
from benchmarks.grid import CONFIGS  # noqa: E402
from benchmarks.metrics import RunResult  # noqa: E402

CONFIG_NAMES = ["off", "chain k=2", "chain k=2 no-overlap", "tree topk=2"]


def test_tiny_suite_controls_acceptance_losslessly(tmp_path):
    md = tmp_path / "BENCHMARKS.md"
    md.write_text(f"# Benchmarks\n\nkept above\n\n{report.BEGIN}\nold section\n{report.END}\n\nkept below\n")
    results = run.main([
        "--device", "cpu", "--tiny", "--parts", "inprocess", "gateway", "--acceptance", "0", "1",
        "--concurrency", "1", "2", "--configs", *CONFIG_NAMES, "--max-new-tokens", "8",
        "--out-dir", str(tmp_path / "out"), "--report", str(md), "--ckpt-dir", str(tmp_path / "ckpt"),
        "--work-dir", str(tmp_path / "work"),
    ])
    rows = json.loads(results.read_text())["rows"]
    cells = {(r["path"], r["config"], r["concurrency"], r["acceptance"]) for r in rows}
    assert len(cells) == len(rows) == 2 * (2 + 2 * 2 * 3)  # paths x (off per C + a x C x speculative)

    for r in rows:
        what = f"{r['path']} {r['config']} C={r['concurrency']} a={r['acceptance']}"
        assert r["tok_s"] > 0 and r["steps"] > 0, what
        if r["config"] == "off":
            assert r["drafted"] == 0 and r["accept_len"] == 1.0, what
            continue
        cfg = CONFIGS[r["config"]]
        assert r["same_as_off"] == 1.0, f"{what}: tokens differ from mode off"  # lossless
        assert r["drafted"] > 0, what
        if r["acceptance"] == 0:  # every first draft token rejected
            assert r["accepted"] == 0 and r["accept_len"] == 1.0, what
            if cfg.mode == "chain" and cfg.overlap:
                assert r["overlap_hit"] == 0.0, what
        elif cfg.mode == "chain":  # a = 1: the whole chain, every step
            assert r["accepted"] == r["drafted"] and r["accept_len"] == cfg.k + 1, what
            if cfg.overlap:
                assert r["overlap_hit"] == 1.0, what
        else:  # a = 1, tree: the whole path to its deepest node (the planted draft head fills every depth)
            assert r["accepted"] == r["steps"] * cfg.depth and r["accept_len"] == cfg.depth + 1, what
            if r["path"] == "in-process":
                assert r["min_step_accepted"] == cfg.depth and r["draft_depth"] == cfg.depth, what

    text = md.read_text()
    assert "old section" not in text and text.count(report.BEGIN) == 1
    assert text.startswith("# Benchmarks\n\nkept above\n") and text.rstrip().endswith("kept below")
    section = text.split(report.BEGIN)[1].split(report.END)[0]
    assert "share the one GPU" in section and "| 1 | chain k=2 |" in section
    assert (tmp_path / "out" / "section.md").exists()


def test_controlled_drafter_keeps_each_position_with_probability_a(checkpoints, tmp_path):
    """Keep rate near a on chains; an overlap pre-draft (assumed tokens) and a later re-draft of the
    same positions decide alike; tree nodes off the main path never propose the reference token."""
    import random

    import torch

    from drafter_svc.controlled import ControlledAcceptanceDrafter
    from drafter_svc.types import ChainShape, DraftItem, DrafterStep, TreeShape
    from specdec.config import ControlledAcceptance
    from specdec.model.loader import load_model
    from specdec.model.runner import ModelRunner

    rng = random.Random(3)
    refs = [([rng.randrange(3, 384) for _ in range(rng.randint(3, 6))], [rng.randrange(3, 384) for _ in range(40)])
            for _ in range(8)]
    path = tmp_path / "ref.json"
    ControlledAcceptance.write_references(path, refs)
    eng = ControlledAcceptanceDrafter(ModelRunner(load_model(checkpoints["llama-gqa/draft"], torch.float64,
                                                             torch.device("cpu"))), 8, 128,
                                      ControlledAcceptance.from_file(path, 0.6, seed=5))
    full = [p + o for p, o in refs]
    first = eng.step(DrafterStep(1, [DraftItem(f"s{i}", len(p) + 1, p + o[:1], [], ChainShape(16))
                                     for i, (p, o) in enumerate(refs)])).drafts
    kept = [t == full[i][len(refs[i][0]) + 1 + j] for i, d in enumerate(first) for j, t in enumerate(d.tree.token_ids)]
    assert abs(sum(kept) / len(kept) - 0.6) < 0.15

    # A pre-draft assuming 3 tokens (positions +3..+7), then 4 tokens committed and a re-draft
    # (positions +4..+7, its nodes numbered differently): the same positions decide alike.
    p0, o0 = refs[0]
    pre = eng.step(DrafterStep(2, [DraftItem("s0", len(p0) + 1, [], o0[1:4], ChainShape(5))])).drafts[0].tree
    redo = eng.step(DrafterStep(3, [DraftItem("s0", len(p0) + 5, o0[1:5], [], ChainShape(4))])).drafts[0].tree
    decided = [[t == o0[5 + j] for j, t in enumerate(tokens)] for tokens in (pre.token_ids[1:], redo.token_ids)]
    assert decided[0] == decided[1]

    eng.control = ControlledAcceptance.from_file(path, 1.0)
    tree = eng.step(DrafterStep(4, [DraftItem("t1", len(refs[1][0]) + 1, full[1][: len(refs[1][0]) + 1], [],
                                              TreeShape(3, 3, 10))], close=["s1"])).drafts[0].tree
    depth = [0]
    for parent in tree.parents:
        depth.append(depth[parent] + 1)
    base = len(refs[1][0])  # position of the root
    is_ref = [t == full[1][base + depth[n]] for n, t in enumerate(tree.token_ids, start=1)]
    on_path = sum(is_ref)
    assert on_path == max(depth)  # a = 1: the whole path to the deepest node, and nothing else


def test_controlled_eagle3_drafter_rewrites_the_heads_drafts(checkpoints, tmp_path):
    """The benchmarks' EAGLE-3 variant: the head drafts from (random) hidden states, and the same
    rewrite makes each chain position the reference with probability a (a = 1: every position)."""
    import random

    import torch
    from test_eagle3_head import write_head

    from drafter_svc.controlled import ControlledEagle3Drafter
    from drafter_svc.eagle3_engine import build_eagle3_drafter
    from drafter_svc.types import ChainShape, DraftItem, DrafterStep
    from specdec.config import ControlledAcceptance

    target = checkpoints["llama-gqa"]
    write_head(target, tmp_path / "head")
    rng = random.Random(4)
    refs = [([rng.randrange(3, 384) for _ in range(5)], [rng.randrange(3, 384) for _ in range(40)]) for _ in range(3)]
    path = tmp_path / "ref.json"
    ControlledAcceptance.write_references(path, refs)
    for a, lo, hi in ((0.6, 0.45, 0.75), (1.0, 1.0, 1.0)):
        eng = build_eagle3_drafter(target, tmp_path / "head", torch.float64, torch.device("cpu"), 4, 128,
                                   engine_class=ControlledEagle3Drafter,
                                   control=ControlledAcceptance.from_file(path, a, seed=2))
        assert isinstance(eng, ControlledEagle3Drafter)
        kept = []
        for i, (p, o) in enumerate(refs):
            committed = p + o[:1]
            hidden = torch.randn(len(committed) - 1, eng.aux_width, dtype=torch.float64)
            draft = eng.step(DrafterStep(1, [DraftItem(f"s{i}", len(committed), committed, [], ChainShape(16),
                                                       hidden=hidden)])).drafts[0].tree
            kept += [t == o[1 + j] for j, t in enumerate(draft.token_ids)]
        assert len(kept) == 48 and lo <= sum(kept) / len(kept) <= hi, (a, sum(kept) / len(kept))


def test_the_machine_line_names_the_cpu_and_its_python_speed(monkeypatch):
    """Runs from hosts of one GPU kind differ in their host Python speed: the machine line records
    the CPU and benchmarks/host_speed.py's figure, which grows when the host runs Python slower."""
    import re

    from benchmarks import host_speed

    desc, gpu = run.machine("cpu")
    assert gpu == "CPU" and host_speed.cpu_model() in desc
    fast = float(re.search(r"host Python ([0-9.]+) ms", desc).group(1))
    assert fast > 0

    real = host_speed._workload
    monkeypatch.setattr(host_speed, "_workload", lambda: (real(), real(), real()))   # a host 3x as slow
    slow = float(re.search(r"host Python ([0-9.]+) ms", run.machine("cpu")[0]).group(1))
    assert slow > 2 * fast, (fast, slow)


def test_host_keep_draws_equal_the_tensor_draws():
    """The controlled drafter draws its keeps with numpy on the host: the same counter-based
    draws as the torch path (seeds across the whole int64 range, positions past 2**32)."""
    import numpy as np
    import torch

    from specdec.sampling import uniforms

    gen = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.randint(-(2 ** 63), 2 ** 63 - 1, (61,), generator=gen),
                       torch.tensor([0, -1, 2 ** 63 - 1])])
    positions = torch.randint(0, 2 ** 40, (64, 17), generator=gen)
    for salt in (0, 0x4B45):
        want = uniforms(seeds, positions, salt)
        got = uniforms(seeds.numpy(), positions.numpy(), salt)
        assert isinstance(got, np.ndarray) and torch.equal(torch.from_numpy(got), want)


def test_tiny_concurrency_sweep_with_auto(tmp_path):
    """The sweep on tiny models: every mode and auto at each (a, C), auto lossless and turning
    speculation off at a = 0 and using it at a = 1, the section with its aims between its own markers."""
    from benchmarks import sweep, sweep_report

    md = tmp_path / "BENCHMARKS.md"
    md.write_text(f"# Benchmarks\n\n{report.BEGIN}\nsuite\n{report.END}\n")
    results = sweep.main([
        "--device", "cpu", "--tiny", "--parts", "random", "--acceptance", "0", "1", "--concurrency", "1", "3",
        "--modes", "off", "chain k=2", "auto", "--max-new-tokens", "24", "--waves", "1",
        "--out-dir", str(tmp_path / "out"),
        "--report", str(md), "--ckpt-dir", str(tmp_path / "ckpt"), "--work-dir", str(tmp_path / "work"),
    ])
    rows = json.loads(results.read_text())["rows"]
    assert len(rows) == 2 + 2 * 2 * 2      # off per C + a x C x (chain, auto)
    by_cell = {(r["config"], r["acceptance"], r["concurrency"]): r for r in rows}
    auto = {(a, c): r for (config, a, c), r in by_cell.items() if config == "auto"}
    assert all(r["same_as_off"] == 1.0 for r in auto.values())
    # a = 1: auto speculates. Not necessarily in every row, and which rows is no test of the policy
    # (tests/test_auto_policy.py prices choices from given costs): each 24-token wave is a few
    # steps on a 2-core machine that CI shares with another test file, so its speed is noise. One
    # loaded run measured auto in off at 735 tok/s against mode off's 212 (the same steps), and a
    # CI run's auto drafted nothing at C = 3 where chain k=2 measured 1.3x of off.
    assert sum(auto[(1.0, c)]["accepted"] for c in (1, 3)) > 0, auto
    for c in (1, 3):
        off = auto[(0.0, c)]
        # off: a few tries while the drafter is new (up to chain k=8 each), far below chain k=2's two
        # tokens every step: at most one draft token per step on average
        assert off["accepted"] == 0 and off["drafted"] <= off["steps"], off
    # the gateway's step split over each measured wave: overlap's pre-drafts ran beside the verify
    for (config, a, c), r in by_cell.items():
        assert r["verify_ms"] > 0 and r["wave_tok_s"] == [r["tok_s"]], r
        if config == "off":
            assert r["overlap_hidden"] is None and r["draft_ms"] == 0, r
        elif config == "chain k=2":
            assert r["draft_ms"] > 0 and r["predraft_ms"] > 0 and 0 < r["overlap_hidden"] <= 1, r
            assert r["predraft_exposed_ms"] <= r["predraft_ms"], r
    text = md.read_text()
    assert "suite" in text and text.count(sweep_report.BEGIN) == 1 and sweep_report.END in text
    section = text.split(sweep_report.BEGIN)[1]
    assert "### tiny random, a = 1" in section and "auto / best fixed" in section and "### Aims" in section


def test_sweep_ratios_pair_the_waves_that_ran_side_by_side():
    """auto against another mode: the median of their waves' ratios (wave i of each ran in turn), so a
    slow spell that took one mode's wave 1 and every mode's wave 2 does not read as auto's loss."""
    from benchmarks.sweep_report import comparison

    def row(config: str, waves: list[float]) -> RunResult:
        return RunResult("gateway", "p", config, 32, 0.8, sorted(waves)[1], 8.0, 9.0, 50.0, 20.0, 100, 0, 0, 1.0, None,
                         wave_tok_s=waves)

    # H100, C = 32: chain's and auto's waves 2 and auto's wave 1 ran in a slow spell
    off, chain, auto = row("off", [2724, 2371, 2610]), row("chain k=4", [3668, 2666, 3573]), \
        row("auto", [2907, 3093, 3442])
    d = comparison([off, chain, auto])[0]
    assert d["best_name"] == "chain k=4"
    assert d["vs_best"] == pytest.approx(3442 / 3573)   # the waves' ratios: 0.79, 1.16, 0.96
    assert d["waves_vs_best"] == pytest.approx([2907 / 3668, 3093 / 2666, 3442 / 3573])
    assert d["vs_off"] == pytest.approx(statistics.median([2907 / 2724, 3093 / 2371, 3442 / 2610]))
    chain.wave_tok_s = []   # rows without their waves (older results): the rows' ratio
    assert comparison([off, chain, auto])[0]["vs_best"] == pytest.approx(3093 / 3573)


def test_step_split_share_of_drafter_time_hidden():
    """Over 10 gateway steps: 20 ms of drafts before the verify, 60 ms of pre-drafts beside it of
    which 6 ms outlasted the verdict -> 54 of the drafter's 80 ms were off the step's path."""
    from benchmarks.step_split import split

    before = {"step": (1.0, 5), "verify_engine": (0.8, 5), "draft_engine": (0.4, 2), "transport": (0.1, 5),
              "gateway": (0.05, 5), "draft": (0.5, 2), "predraft": (0.3, 3), "predraft_exposed": (0.01, 3)}
    after = {"step": (2.0, 15), "verify_engine": (0.85, 15), "draft_engine": (0.41, 4), "transport": (0.13, 15),
             "gateway": (0.054, 15), "draft": (0.52, 4), "predraft": (0.36, 13), "predraft_exposed": (0.016, 13)}
    got = split(before, after)
    assert got["loop_step_ms"] == pytest.approx(100.0) and got["verify_ms"] == pytest.approx(5.0)
    assert got["draft_engine_ms"] == pytest.approx(1.0) and got["transport_ms"] == pytest.approx(3.0)
    assert got["gateway_ms"] == pytest.approx(0.4)
    assert got["draft_ms"] == pytest.approx(2.0) and got["predraft_ms"] == pytest.approx(6.0)
    assert got["predraft_exposed_ms"] == pytest.approx(0.6)
    assert got["overlap_hidden"] == pytest.approx(54 / 80)
    assert split(before, before) == {}                                    # no step between: nothing to say
    idle = dict(before, step=(1.5, 9))
    assert split(before, idle)["overlap_hidden"] is None                  # steps but no drafts (mode off)


def test_profile_services_charges_samples_to_the_repositorys_functions():
    """scripts/profile_services.py's reading of py-spy's raw stacks: inclusive shares count a
    function once per stack, the innermost repository frame takes library time, lines come with
    their callees; library-only stacks count as outside."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "scripts"))
    from profile_services import by_line, innermost, summarize

    raw = "\n".join([
        "run (specdec/serving.py:92);step (drafter_svc/engine.py:70);step (drafter_svc/engine.py:70);"
        "tolist (torch/_tensor.py:1) 6",
        f"run (specdec/serving.py:92);_feed ({root}/drafter_svc/engine.py:120) 3",
        "select (selectors.py:10) 1",
    ])
    assert summarize(raw, str(root)) == [(0.9, "run specdec/serving.py"), (0.6, "step drafter_svc/engine.py"),
                                         (0.3, "_feed drafter_svc/engine.py")]
    assert innermost(raw, str(root)) == [(0.6, "step drafter_svc/engine.py"), (0.3, "_feed drafter_svc/engine.py"),
                                         (0.1, "(outside the repository)")]
    assert by_line(raw, "step") == [(6, "70 -> tolist")]
