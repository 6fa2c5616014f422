"""Sampling through the real gateway, drafter and verifier processes follows the target's exact
distribution (tests/distribution.py: 6-token vocabulary, every continuation enumerated, Pearson's
chi-square with cells < 5 merged, rejected above dof + 6 sqrt(2 dof)).

Cases: chain with overlap (pre-drafts reused), top-k with temperatures 0.7 / 1.5 (and top-p, in
tree mode), n = 16 samples per request (independent of each other, seeds derived from the
request's), a batch mixing greedy and sampled requests, a tensor-parallel verifier (gloo), and a
drafter lost mid-request. Every request asks for n = 16 samples and many run at once (one
full concurrent batch per case). In each case a request run again alone gives the same tokens
as inside the batch (counter-based seeds).

Power: for chain cases N is chosen so that the subtle broken rule "after a rejection resample
from p instead of the residual max(0, p - q)" would give an expected statistic at least twice
the bound (asserted, computed exactly by tests/distribution.chain_distribution); accepting every
draft lands orders of magnitude higher.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from cluster import request
from distribution import (
    assert_matches,
    bound,
    chain_distribution,
    chi_square,
    counts_at,
    exact_distribution,
    expected_statistic,
    hf_greedy_many,
    marginal,
    next_token_probs,
)
from model_factory import hf_greedy, make_tiny_vocab_checkpoint
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gateway.request import GOLDEN
from specdec.rpc import gateway_pb2
from specdec.sampling import SamplingParams
from specdec.tree import DraftTree, Proposal

VOCAB = 6
N_PER_REQUEST = 16  # samples per request
WORKERS = 32        # concurrent requests: up to 512 sequences per batched step


def save_word_tokenizer(directory: Path, vocab: int = VOCAB) -> None:
    """A word-level tokenizer over ids 0..vocab-1 ("t0".."t5"): lets the gateway start on the checkpoint."""
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(directory)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, Path]:
    """The engine test's pair: independent random target and draft (seeds 1 and 2), with a tokenizer."""
    root = tmp_path_factory.mktemp("tiny-vocab-gateway")
    pair = make_tiny_vocab_checkpoint(root / "target", seed=1), make_tiny_vocab_checkpoint(root / "draft", seed=2)
    for d in pair:
        save_word_tokenizer(d)
    return pair


@pytest.fixture(scope="module")
def cluster(tiny, start_cluster):
    return start_cluster(*tiny, extra=["--max-sequences", "1024"], hold=True,
                         gateway_extra=["--max-queue", "4096", "--resolve-interval", "0.5"])


# ---- running many requests ------------------------------------------------------------------------------


@dataclass
class Job:
    prompt: list[int]
    tokens: int
    mode: str
    spec: dict
    sampling: dict          # temperature, top_p, top_k, seed (n is added)
    n: int = N_PER_REQUEST
    request_id: str = ""


@dataclass
class Result:
    samples: list[list[int]]
    finals: list[gateway_pb2.FinalInfo]


@dataclass
class Progress:
    """Tokens received so far per (request, sample), for waiting on held requests."""
    counts: dict = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def add(self, key, n: int) -> None:
        with self.cond:
            self.counts[key] = self.counts.get(key, 0) + n
            self.cond.notify_all()

    def wait(self, keys, at_least: int, timeout: float = 120.0) -> None:
        with self.cond:
            ok = self.cond.wait_for(lambda: all(self.counts.get(k, 0) >= at_least for k in keys), timeout)
        assert ok, f"held samples did not reach {at_least} tokens: {sorted(self.counts.values())[:8]}"


def run(cluster, job: Job, progress: Progress | None = None) -> Result:
    req = request(job.prompt, job.tokens, job.mode, **job.spec)
    req.request_id = job.request_id
    req.sampling.CopyFrom(gateway_pb2.Sampling(**job.sampling, n=job.n))
    samples: list[list[int]] = [[] for _ in range(job.n)]
    finals: list = [None] * job.n
    for msg in cluster.gateway.Generate(req, timeout=300):
        samples[msg.sample_index] += msg.token_ids
        if progress is not None and msg.token_ids:
            progress.add((job.request_id, msg.sample_index), len(msg.token_ids))
        if msg.HasField("final"):
            finals[msg.sample_index] = msg.final
    assert all(f is not None for f in finals) and all(len(s) == job.tokens for s in samples), samples
    return Result(samples, finals)


def run_batch(cluster, jobs: list[Job], workers: int = WORKERS) -> list[Result]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda job: run(cluster, job), jobs))


def sampled_jobs(count: int, prompt, tokens, mode, spec, params: SamplingParams, seed0: int) -> list[Job]:
    sampling = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k}
    return [Job(prompt, tokens, mode, spec, {**sampling, "seed": seed0 + i}) for i in range(count)]


def all_samples(results: list[Result]) -> list[list[int]]:
    return [s for r in results for s in r.samples]


def assert_same_alone(cluster, jobs: list[Job], results: list[Result], which=(0, -1)) -> None:
    """Counter-based seeds: a request run alone gives the tokens it got inside the full batch."""
    for i in which:
        alone = run(cluster, jobs[i])
        assert alone.samples == results[i].samples, f"request {i} alone differs from the batch"


def assert_powerful(exact: dict, broken: dict, n: int) -> None:
    """N is large enough: samples from the `broken` distribution would land far above the bound."""
    _, dof = chi_square(Counter(), exact, n)
    expected = expected_statistic(exact, broken, n)
    assert expected > 2 * bound(dof), f"N={n} is too small: a broken rule expects chi2={expected:.0f} only"


def assert_chain_powerful(target, draft, prompt, params, k, tokens, positions, n) -> None:
    """Against a chain rule that resamples from p after a rejection (instead of the residual)."""
    assert_powerful(marginal(exact_distribution(target, prompt, params, tokens), positions),
                    marginal(chain_distribution(target, draft, prompt, params, k, tokens, "resample_from_target"),
                             positions), n)


# ---- a. chain with overlap ------------------------------------------------------------------------------


def test_chain_overlap_follows_the_target_distribution(cluster, tiny):
    """k = 1 with overlap: a fully accepted step whose bonus matches the pre-draft's first token
    verifies the pre-draft's second token at position 4, so the 4th token is where pre-drafts are
    reused; the statistic is over tokens 2-4 (216 outcomes)."""
    target, draft = tiny
    prompt, params, k, tokens, positions, n = [5, 5, 2], SamplingParams(1.0), 1, 4, (1, 2, 3), 3072
    assert_chain_powerful(target, draft, prompt, params, k, tokens, positions, n)
    jobs = sampled_jobs(n // N_PER_REQUEST, prompt, tokens, "chain", {"k": k, "overlap": True}, params, 10_000)
    results = run_batch(cluster, jobs)
    finals = [f for r in results for f in r.finals]
    assert sum(f.stats.overlap_hits for f in finals) > n // 10, "pre-drafts were hardly reused"
    assert_matches(counts_at(all_samples(results), positions),
                   marginal(exact_distribution(target, prompt, params, tokens), positions), "chain+overlap")
    assert_same_alone(cluster, jobs, results)


def test_a_reused_pre_draft_keeps_each_token_proposal():
    """What the gateway verifies after an overlap hit (the pre-draft minus its first token) carries
    each token's own proposal q. A misaligned q here is lossy but too rare in the test above
    (hits x a small q shift: about 1% of the distribution) for N = 3072 to see, hence this check."""
    proposals = [Proposal([0, 1, 2], [0.5, 0.3, 0.2]), Proposal([1, 3], [0.6, 0.4]), Proposal([2, 4], [0.9, 0.1])]
    suffix = DraftTree.chain([0, 3, 4], [-0.7, -0.9, -2.3], proposals).suffix(1)
    assert suffix == DraftTree([3, 4], [0, 1], [-0.9, -2.3], proposals[1:])


# ---- b. top-k, temperature, top-p -----------------------------------------------------------------------


@pytest.mark.parametrize("mode, spec, params, prompt", [
    ("chain", {"k": 2}, SamplingParams(0.7, 1.0, 3), [2, 5, 1]),
    ("tree", {"topk": 2, "depth": 2, "budget": 4}, SamplingParams(1.5, 0.8, 3), [3, 3, 4]),
], ids=["chain-T0.7-topk3", "tree-T1.5-topk3-topp0.8"])
def test_top_k_top_p_and_temperature_follow_the_target_distribution(cluster, tiny, mode, spec, params, prompt):
    """Three tokens, at most 3 candidates each: 27 outcomes (fewer with top-p), N = 1024.
    No sample may fall outside the top-k / top-p support."""
    target, draft = tiny
    n, tokens = 1024, 3
    if mode == "chain":
        assert_chain_powerful(target, draft, prompt, params, spec["k"], tokens, (0, 1, 2), n)
    jobs = sampled_jobs(n // N_PER_REQUEST, prompt, tokens, mode, spec, params, 20_000)
    results = run_batch(cluster, jobs)
    assert_matches(counts_at(all_samples(results), (0, 1, 2)), exact_distribution(target, prompt, params, tokens),
                   f"{mode} {params}")
    assert_same_alone(cluster, jobs, results)


# ---- c. n = 16 samples per request ----------------------------------------------------------------------


def collision_z(samples_by_request: list[list[tuple]], exact: dict) -> float:
    """z-score of the number of identical pairs among each request's samples against independence:
    per request of m samples, E = C(m,2) s and Var = C(m,2)(s - s^2) + 6 C(m,3)(t - s^2), where
    s = sum p^2 and t = sum p^3 (pairs sharing a sample are correlated, disjoint ones are not)."""
    s = sum(p * p for p in exact.values())
    t = sum(p ** 3 for p in exact.values())
    observed = mean = var = 0.0
    for outs in samples_by_request:
        m = len(outs)
        observed += sum(math.comb(c, 2) for c in Counter(outs).values())
        mean += math.comb(m, 2) * s
        var += math.comb(m, 2) * (s - s * s) + 6 * math.comb(m, 3) * (t - s * s)
    return (observed - mean) / math.sqrt(var)


def test_n_samples_of_one_request_are_independent_draws(cluster, tiny):
    """192 requests of n = 16 (N = 3072, 216 outcomes): pooled, the samples follow the exact
    distribution; within a request they are independent (identical pairs as often as chance
    says); sample i uses the seed the request's seed derives for it (the same tokens as an n = 1
    request with that seed)."""
    target, draft = tiny
    prompt, params, k, tokens, n = [5, 3, 2], SamplingParams(1.0, 0.95), 2, 3, 3072
    assert_chain_powerful(target, draft, prompt, params, k, tokens, (0, 1, 2), n)
    exact = exact_distribution(target, prompt, params, tokens)
    jobs = sampled_jobs(n // N_PER_REQUEST, prompt, tokens, "chain", {"k": k}, params, 30_000)
    results = run_batch(cluster, jobs)
    assert_matches(counts_at(all_samples(results), (0, 1, 2)), exact, "n=16")
    z = collision_z([[tuple(s) for s in r.samples] for r in results], exact)
    print(f"identical pairs within requests: collision z = {z:.2f}")
    assert abs(z) < 6, f"samples of one request are not independent: collision z = {z:.1f}"
    first = jobs[0]
    seeds = [(first.sampling["seed"] + i * GOLDEN) % (1 << 64) for i in range(N_PER_REQUEST)]
    assert [f.seed for f in results[0].finals] == seeds
    for i in (0, 7, 15):
        single = run(cluster, Job(first.prompt, tokens, "chain", first.spec, {**first.sampling, "seed": seeds[i]}, n=1))
        assert single.samples[0] == results[0].samples[i], f"sample {i} is not the n=1 request of its seed"
    assert_same_alone(cluster, jobs, results)


# ---- d. greedy and sampled requests in one batch --------------------------------------------------------


def test_a_batch_mixing_greedy_and_sampled_requests(cluster, tiny):
    """Greedy requests (n = 1 and n = 4, modes chain / tree / off, 12 tokens) interleaved with
    sampled ones (chain k = 3, top-k 4; N = 1024 over 3 tokens): the greedy ones equal HF greedy
    exactly, the sampled ones follow the exact distribution."""
    target, draft = tiny
    prompt, params, k, tokens, n = [5, 5, 2], SamplingParams(1.0, 1.0, 4), 3, 3, 1024
    assert_chain_powerful(target, draft, prompt, params, k, tokens, (0, 1, 2), n)
    sampled = sampled_jobs(n // N_PER_REQUEST, prompt, tokens, "chain", {"k": k}, params, 40_000)
    greedy_prompts = [list(p) for p in itertools.islice(itertools.product(range(VOCAB), repeat=3), 1, 200, 13)]
    modes = [("chain", {"k": 3}), ("tree", {"topk": 2, "depth": 3, "budget": 6}), ("off", {})]
    greedy = [Job(p, 12, *modes[i % 3], {"temperature": 0.0}, n=1 + 3 * (i % 2)) for i, p in enumerate(greedy_prompts)]
    jobs = [j for i in range(0, len(sampled), 4) for j in (*sampled[i:i + 4], *greedy[i // 4:i // 4 + 1])]
    assert len(jobs) == len(sampled) + len(greedy)
    results = dict(zip(map(id, jobs), run_batch(cluster, jobs)))
    expected = hf_greedy_many(target, greedy_prompts, 12)
    assert expected[0] == hf_greedy(target, greedy_prompts[0], 12)
    for job, want in zip(greedy, expected):
        assert all(s == want for s in results[id(job)].samples), f"greedy {job.mode} {job.prompt}"
    sampled_results = [results[id(j)] for j in sampled]
    assert_matches(counts_at(all_samples(sampled_results), (0, 1, 2)),
                   exact_distribution(target, prompt, params, tokens), "sampled in a mixed batch")
    assert_same_alone(cluster, sampled, sampled_results)


# ---- e. tensor-parallel verifier ------------------------------------------------------------------------


def test_tensor_parallel_verifier_follows_the_target_distribution(tiny, start_cluster):
    """The verifier sharded over 2 CPU ranks (gloo): chain k = 2, T = 0.9, top-k 4, N = 1024."""
    target, draft = tiny
    tp = start_cluster(target, draft, extra=["--max-sequences", "512"], verifier_extra=["--tp", "2"],
                       gateway_extra=["--max-queue", "4096"])
    prompt, params, k, tokens, n = [2, 5, 1], SamplingParams(0.9, 1.0, 4), 2, 3, 1024
    assert_chain_powerful(target, draft, prompt, params, k, tokens, (0, 1, 2), n)
    jobs = sampled_jobs(n // N_PER_REQUEST, prompt, tokens, "chain", {"k": k}, params, 50_000)
    results = run_batch(tp, jobs)
    assert_matches(counts_at(all_samples(results), (0, 1, 2)), exact_distribution(target, prompt, params, tokens),
                   "tp=2")
    assert_same_alone(tp, jobs, results)


# ---- e2. an EAGLE-3 drafter --------------------------------------------------------------------------------


def test_eagle3_drafter_follows_the_target_distribution(tiny, start_cluster, tmp_path):
    """Drafts from an EAGLE-3 head (random, in the published layout, a draft vocabulary of 4 of the
    6 tokens) fed with the verifier's hidden states: point-mass drafts, so the verifier uses the
    deterministic-children rule. Chain k = 2 with overlap, and trees (top-k 2, depth 2, budget 4):
    T = 0.9, top-k 4, N = 1024 each."""
    from test_eagle3_head import write_head

    target, _ = tiny
    write_head(target, tmp_path / "head", aux=(0, 1, 1), draft_vocab=4)  # layer outputs -> inputs 1, 2, 2
    eagle = start_cluster(target, target, extra=["--max-sequences", "512"],
                          verifier_extra=["--aux-hidden-layers", "1,2,2"],
                          drafter_extra=["--eagle3-head", str(tmp_path / "head")], gateway_extra=["--max-queue", "4096"])
    prompt, params, tokens, n = [2, 5, 1], SamplingParams(0.9, 1.0, 4), 3, 1024
    exact = exact_distribution(target, prompt, params, tokens)
    for seed, mode, spec in ((60_000, "chain", {"k": 2}), (70_000, "tree", {"topk": 2, "depth": 2, "budget": 4})):
        jobs = sampled_jobs(n // N_PER_REQUEST, prompt, tokens, mode, spec, params, seed)
        results = run_batch(eagle, jobs)
        assert all(f.stats.mode == mode and f.stats.drafted > 0 for r in results for f in r.finals)
        assert_matches(counts_at(all_samples(results), (0, 1, 2)), exact, f"eagle3 {mode}")
        assert_same_alone(eagle, jobs, results)


# ---- e2. mode auto switching shapes every step ------------------------------------------------------------


def test_auto_switching_shapes_follows_the_target_distribution(tiny, start_cluster):
    """--test-auto-cycle: each step of the batch takes the next of auto's choices (off, chains with
    and without overlap, trees), so a request's tokens come from different rules step by step; the
    output still follows the exact distribution (T = 1, N = 3072 over tokens 1-3)."""
    target, draft = tiny
    auto = start_cluster(target, draft, extra=["--max-sequences", "512", "--cost-profile"],
                         gateway_extra=["--max-queue", "4096", "--test-auto-cycle"])
    prompt, params, tokens, positions, n = [5, 5, 2], SamplingParams(1.0), 4, (1, 2, 3), 3072
    assert_chain_powerful(target, draft, prompt, params, 2, tokens, positions, n)
    results = run_batch(auto, sampled_jobs(n // N_PER_REQUEST, prompt, tokens, "auto", {}, params, 80_000))
    finals = [f for r in results for f in r.finals]
    used = Counter(name for f in finals for name, steps in f.stats.steps_by_mode.items() if steps)
    assert len(used) >= 6 and used["off"] and any(name.startswith("tree") for name in used), used
    assert_matches(counts_at(all_samples(results), positions),
                   marginal(exact_distribution(target, prompt, params, tokens), positions), "auto cycling")


# ---- f. the drafter lost mid-request (last: it kills the module cluster's drafter) ----------------------


def wait_speculating(cluster, timeout: float = 60.0) -> None:
    """Until the gateway routes new requests to a drafter again (its health checks see it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, final = cluster.generate([1, 2, 3], 2, "chain", k=1)
        if final.stats.mode == "chain":
            return
        time.sleep(0.2)
    raise AssertionError("the restarted drafter is not used")


def lost_drafter_distribution(target, draft, prompt, params, rule: str) -> dict:
    """P(4 tokens) of the protocol below (chain k = 1, held at 2 tokens, then mode off) under a
    chain rule ("exact" gives the target's distribution; "resample_from_target" draws from p
    after a rejection): token 1 from the prefill; step 1 verifies one draft at 2: accepted, the
    bonus at 3 follows and the pre-draft (drafted alongside) is still verified at 4 if its first
    token equals the bonus; rejected, tokens 3 and 4 are plain sampling."""
    outcomes, p = next_token_probs(Path(target), tuple(prompt), params, 4)
    _, q = next_token_probs(Path(draft), tuple(prompt), params, 4)
    idx = torch.tensor(outcomes)[..., None]
    p_x, q_x = p.gather(-1, idx)[..., 0], q.gather(-1, idx)[..., 0]                # [O, 4]
    both = torch.minimum(p, q)
    accept = both.gather(-1, idx)[..., 0]
    reject = p_x - accept if rule == "exact" else (1 - both.sum(-1)) * p_x
    verified = accept + reject                                                     # a draft checked there
    hit = q_x[:, 2]                                                                # pre-draft's token 3 == bonus
    prob = p_x[:, 0] * p_x[:, 2] * (accept[:, 1] * (hit * verified[:, 3] + (1 - hit) * p_x[:, 3])
                                    + reject[:, 1] * p_x[:, 3])
    return dict(zip(outcomes, prob.tolist()))


def run_losing_the_drafter(cluster, jobs: list[Job], after_tokens: int) -> list[Result]:
    """Hold every request at `after_tokens`, kill the drafter once all samples got there, release."""
    progress = Progress()
    for job in jobs:
        cluster.hold(job.request_id, after_tokens)
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(run, cluster, job, progress) for job in jobs]
        try:
            progress.wait([(job.request_id, i) for job in jobs for i in range(job.n)], after_tokens)
            cluster.kill("drafter")
        finally:
            for job in jobs:
                cluster.release(job.request_id)
        return [f.result() for f in futures]


def test_a_drafter_lost_mid_request_while_sampling(cluster, tiny):
    """64 requests of n = 16 (chain k = 1, top-k 3, 4 tokens) held after 2 tokens (the prefill's
    and one verify step's), the drafter killed, then released: every sample finishes in mode off
    (a pre-draft already made is still verified: some samples drafted twice), and tokens 2-4
    follow the exact distribution (N = 1024, 27 outcomes). Alone (the drafter restarted, the same
    hold and kill), a request gives the tokens it got in the batch."""
    target, draft = tiny
    prompt, params, tokens, positions, n = [5, 5, 2], SamplingParams(1.0, 1.0, 3), 4, (1, 2, 3), 1024
    exact = marginal(exact_distribution(target, prompt, params, tokens), positions)
    assert_powerful(exact, marginal(lost_drafter_distribution(target, draft, prompt, params, "resample_from_target"),
                                    positions), n)
    jobs = sampled_jobs(n // N_PER_REQUEST, prompt, tokens, "chain", {"k": 1}, params, 60_000)
    for i, job in enumerate(jobs):
        job.request_id = f"lost-drafter-{i}"
    results = run_losing_the_drafter(cluster, jobs, after_tokens=2)
    finals = [f for r in results for f in r.finals]
    assert all(f.stats.mode == "off" for f in finals)
    assert {f.stats.drafted for f in finals} == {1, 2}  # 2: a pending pre-draft verified after the loss
    assert_matches(counts_at(all_samples(results), positions), exact, "drafter lost")
    cluster.restart("drafter")
    wait_speculating(cluster)
    alone = Job(**{**jobs[0].__dict__, "request_id": "lost-drafter-alone"})
    (again,) = run_losing_the_drafter(cluster, [alone], after_tokens=2)
    assert again.samples == results[0].samples
    assert all(f.stats.mode == "off" for f in again.finals)
