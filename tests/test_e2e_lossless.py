"""Lossless end to end: three real processes over real gRPC produce exactly HF transformers'
greedy output (generate, do_sample=False) in every mode, for several model shapes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from model_factory import hf_greedy

PROMPTS = [[1, 17, 42, 99, 5], [300, 12, 7], list(range(40, 71))]
NEW_TOKENS = 24
MODES = [
    ("off", {}),
    ("chain", {"k": 4}),                       # overlap on (the default)
    ("chain", {"k": 3, "overlap": False}),
    ("tree", {"topk": 2, "depth": 3, "budget": 7}),
    ("tree", {"topk": 4, "depth": 4, "budget": 16}),
]
# Draft shapes past the defaults, up to the limits (specdec/limits.py: MAX_CHAIN_K 16,
# MAX_TREE_TOPK 8, MAX_TREE_DEPTH 10, MAX_TREE_BUDGET 64 = the verifier's --max-draft-tokens),
# run on one model shape only to keep the suite short.
LARGE_MODES = [
    ("chain", {"k": 8}),
    ("chain", {"k": 16}),                              # its overlap pre-draft is k + 1 = 17 tokens
    ("chain", {"k": 8, "overlap": False}),
    ("chain", {"k": 16, "overlap": False}),
    ("tree", {"topk": 2, "depth": 6, "budget": 22}),   # every candidate kept: depth-6 nodes verified
    ("tree", {"topk": 1, "depth": 10, "budget": 10}),
    ("tree", {"topk": 8, "depth": 4, "budget": 32}),
    ("tree", {"topk": 8, "depth": 10, "budget": 64}),
]
LARGE_SHAPE = "llama-gqa"


def check_every_mode(cluster, target, modes) -> None:
    """Every prompt in every mode equals HF generate, with consistent stats."""
    for prompt in PROMPTS:
        expected = hf_greedy(target, prompt, NEW_TOKENS)
        for mode, spec in modes:
            ids, final = cluster.generate(prompt, NEW_TOKENS, mode, **spec)
            assert ids == expected, f"{target.name} {mode} {spec} prompt={prompt}"
            assert final.stats.mode == mode
            assert final.completion_tokens == NEW_TOKENS and final.finish_reason == "length"
            if mode != "off":
                assert final.stats.steps < NEW_TOKENS  # the one-layer draft gets some tokens accepted
                assert final.stats.mean_accepted_length > 1.0


@pytest.mark.parametrize("shape", ["llama-gqa", "llama-tied", "qwen2-bias", "mistral"])
def test_every_mode_matches_hf_generate(shape, checkpoints, start_cluster):
    modes = MODES + LARGE_MODES if shape == LARGE_SHAPE else MODES
    check_every_mode(start_cluster(checkpoints[shape], checkpoints[f"{shape}/draft"]), checkpoints[shape], modes)


@pytest.fixture(scope="module")
def self_drafted(checkpoints, start_cluster):
    """The target as its own drafter: every draft token is the target's greedy choice."""
    return start_cluster(checkpoints["llama-gqa"], checkpoints["llama-gqa"])


@pytest.mark.parametrize("mode, spec, steps", [
    pytest.param("chain", {"k": 4}, 5, id="chain-k4"),
    pytest.param("chain", {"k": 15}, 2, id="chain-k15"),
    pytest.param("chain", {"k": 16, "overlap": False}, 2, id="chain-k16-no-overlap"),
    pytest.param("chain", {"k": 16}, 2, id="chain-k16"),  # the pre-draft asks for k + 1 = 17 tokens
    pytest.param("tree", {"topk": 1, "depth": 10, "budget": 10}, 2, id="tree-depth10"),
    # For this prompt the target's greedy path stays in the top-2 frontier at every depth, so each
    # step accepts six nodes spread over the tree (KV compaction over six levels).
    pytest.param("tree", {"topk": 2, "depth": 6, "budget": 22}, 3, id="tree-depth6-budget22"),
])
def test_draft_equal_to_target_accepts_full_paths(self_drafted, checkpoints, mode, spec, steps):
    """Self-drafting: every step accepts a longest path (k or depth nodes) plus the bonus token,
    and every chain pre-draft is an overlap hit."""
    longest = spec.get("k") or spec["depth"]
    drafted = spec.get("k") or spec["budget"]  # these trees keep all their candidates
    new_tokens = 1 + steps * (longest + 1)     # 1 token from the prefill, then full steps
    ids, final = self_drafted.generate(PROMPTS[0], new_tokens, mode, **spec)
    assert ids == hf_greedy(checkpoints["llama-gqa"], PROMPTS[0], new_tokens)
    s = final.stats
    assert s.mode == mode and s.steps == steps and s.mean_accepted_length == longest + 1
    assert s.accepted == steps * longest and s.drafted == steps * drafted
    overlap = mode == "chain" and spec.get("overlap", True)
    assert s.overlap_hits == (steps if overlap else 0) and s.overlap_misses == 0


@pytest.mark.parametrize("fold", [False, True], ids=["prefill-apart", "fold-prefill"])
def test_concurrent_requests_equal_their_solo_runs(checkpoints, start_cluster, fold):
    """16 requests of different prompts, lengths and modes share batched steps; each output is
    what the target alone produces for it. Also with --fold-prefill: prompts arriving while others
    run are prefilled as extra rows of the verify forward."""
    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, checkpoints["llama-gqa/draft"], verifier_extra=["--fold-prefill" if fold else "--no-fold-prefill"])
    jobs = []
    for i in range(16):
        prompt = [(7 * i + j * 13) % 380 + 2 for j in range(3 + i % 5 * 4)]
        mode, spec = MODES[i % len(MODES)]
        jobs.append((prompt, 8 + (i * 5) % 25, mode, spec))
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda j: cluster.generate(j[0], j[1], j[2], **j[3]), jobs))
    for (prompt, n, mode, spec), (ids, _) in zip(jobs, results):
        assert ids == hf_greedy(target, prompt, n), f"{mode} {spec} prompt={prompt}"


# ---- --mode auto ----------------------------------------------------------------------------------------


def test_auto_switching_shapes_every_step_is_lossless(checkpoints, start_cluster):
    """--test-auto-cycle: auto takes each of its choices in turn (off, chains of every k with and
    without overlap, the trees), so a request switches shape at every step, dropping pre-drafts made
    for another shape and catching the drafter up after off steps. Alone and 12 at once (mixed with
    fixed-mode requests), every output equals HF's."""
    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, target, extra=["--cost-profile"],  # self-drafted: long accepts
                            gateway_extra=["--test-auto-cycle"])
    for prompt in PROMPTS:
        ids, final = cluster.generate(prompt, 64, "auto")
        assert ids == hf_greedy(target, prompt, 64)
        s = final.stats
        assert s.mode == "auto" and sum(s.steps_by_mode.values()) == s.steps
        assert {"off", "chain k=4 overlap", "chain k=8", "tree 4/4/16"} <= set(s.steps_by_mode), s.steps_by_mode
        assert s.accepted > 0 and s.overlap_hits > 0
    jobs = [([(7 * i + j * 13) % 380 + 2 for j in range(3 + i % 4 * 5)], 10 + (i * 7) % 30,
             *(("auto", {}) if i % 3 else MODES[i % len(MODES)])) for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(lambda j: cluster.generate(j[0], j[1], j[2], **j[3]), jobs))
    for (prompt, n, mode, spec), (ids, _) in zip(jobs, results):
        assert ids == hf_greedy(target, prompt, n), f"{mode} {spec} prompt={prompt}"


def test_auto_is_the_default_mode_and_stays_lossless(checkpoints, start_cluster):
    """Requests that name no mode run auto (the real policy, with the services' cost profiles)."""
    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, target, extra=["--cost-profile"])
    assert cluster.info("verifier").step_costs and cluster.info("drafter").step_costs
    # Both engines compute on this machine's CPU: auto prices overlap as sharing it.
    accelerators = list(cluster.info("verifier").accelerators)
    assert accelerators == list(cluster.info("drafter").accelerators) and accelerators[0].startswith("cpu@")
    ids, final = cluster.generate(PROMPTS[2], 32, "default")
    assert ids == hf_greedy(target, PROMPTS[2], 32)
    assert final.stats.mode == "auto" and sum(final.stats.steps_by_mode.values()) == final.stats.steps
    assert "drafter_shares_the_verifier_accelerator=True" in (cluster.log_dir / "gateway.log").read_text()
