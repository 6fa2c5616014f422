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


def check_every_mode(cluster, target) -> None:
    """Every prompt in every mode equals HF generate, with consistent stats."""
    for prompt in PROMPTS:
        expected = hf_greedy(target, prompt, NEW_TOKENS)
        for mode, spec in MODES:
            ids, final = cluster.generate(prompt, NEW_TOKENS, mode, **spec)
            assert ids == expected, f"{target.name} {mode} {spec} prompt={prompt}"
            assert final.stats.mode == mode
            assert final.completion_tokens == NEW_TOKENS and final.finish_reason == "length"
            if mode != "off":
                assert final.stats.steps < NEW_TOKENS  # the one-layer draft gets some tokens accepted
                assert final.stats.mean_accepted_length > 1.0


@pytest.mark.parametrize("shape", ["llama-gqa", "llama-tied", "qwen2-bias", "mistral"])
def test_every_mode_matches_hf_generate(shape, checkpoints, start_cluster):
    check_every_mode(start_cluster(checkpoints[shape], checkpoints[f"{shape}/draft"]), checkpoints[shape])


def test_draft_equal_to_target_accepts_everything(checkpoints, start_cluster):
    """Self-drafting: every chain is fully accepted and every pre-draft is an overlap hit."""
    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, target)
    expected = hf_greedy(target, PROMPTS[0], 25)
    ids, final = cluster.generate(PROMPTS[0], 25, "chain", k=4)
    assert ids == expected
    # 1 token from the prefill, then 5 steps of 4 drafts + 1 bonus token each.
    assert final.stats.steps == 5 and final.stats.mean_accepted_length == 5.0
    assert final.stats.accepted == final.stats.drafted == 20
    assert final.stats.overlap_misses == 0 and final.stats.overlap_hits == 5


def test_concurrent_requests_equal_their_solo_runs(checkpoints, start_cluster):
    """16 requests of different prompts, lengths and modes share batched steps; each output is
    what the target alone produces for it."""
    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, checkpoints["llama-gqa/draft"])
    jobs = []
    for i in range(16):
        prompt = [(7 * i + j * 13) % 380 + 2 for j in range(3 + i % 5 * 4)]
        mode, spec = MODES[i % len(MODES)]
        jobs.append((prompt, 8 + (i * 5) % 25, mode, spec))
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda j: cluster.generate(j[0], j[1], j[2], **j[3]), jobs))
    for (prompt, n, mode, spec), (ids, _) in zip(jobs, results):
        assert ids == hf_greedy(target, prompt, n), f"{mode} {spec} prompt={prompt}"
