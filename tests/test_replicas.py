"""Two verifiers and two drafters behind one gateway: requests spread over both replicas of
each service, outputs stay exact, and losing one replica of each loses only the requests that
were running on the lost verifier, while the survivors take new requests."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster import request
from model_factory import hf_greedy

MODES = [("chain", {"k": 3}), ("tree", {"topk": 2, "depth": 3, "budget": 6}), ("off", {}),
         ("chain", {"k": 2, "overlap": False})]


def jobs(count: int, new_tokens: int, seed: int = 0) -> list[tuple[str, list[int], int, str, dict]]:
    return [(f"req-{seed}-{i}", [(11 * i + 3 * j + seed) % 380 + 2 for j in range(3 + i % 4)], new_tokens,
             *MODES[i % len(MODES)]) for i in range(count)]


def run(cluster, job) -> list[int] | grpc.StatusCode:
    rid, prompt, n, mode, spec = job
    req = request(prompt, n, mode, **spec)
    req.request_id = rid
    ids = []
    try:
        for msg in cluster.gateway.Generate(req, timeout=120):
            ids += msg.token_ids
    except grpc.RpcError as exc:
        return exc.code()
    return ids


@pytest.fixture
def replicated(checkpoints, start_cluster):
    return start_cluster(checkpoints["llama-gqa"], checkpoints["llama-gqa/draft"], verifiers=2, drafters=2,
                         gateway_extra=["--resolve-interval", "0.5"])


def test_sixteen_requests_spread_over_both_replicas(replicated, checkpoints):
    target = checkpoints["llama-gqa"]
    work = jobs(16, 24)
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda j: run(replicated, j), work))
    for (rid, prompt, n, mode, spec), ids in zip(work, results):
        assert ids == hf_greedy(target, prompt, n), f"{rid} {mode} {spec}"
    for name in ("verifier", "verifier.1", "drafter", "drafter.1"):
        assert replicated.info(name).sequences_opened > 0, f"{name} carried no request"


def test_losing_one_replica_of_each(replicated, checkpoints):
    target = checkpoints["llama-gqa"]
    work = jobs(12, 200, seed=1)
    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(run, replicated, j) for j in work]
        time.sleep(1.0)  # all requests are pinned and running
        replicated.kill("verifier.1")
        replicated.kill("drafter.1")
        results = [f.result() for f in futures]
    log = (replicated.log_dir / "gateway.log").read_text()
    lost = replicated.addr["verifier.1"]
    pinned = dict(re.findall(r"request started.*?request_id=(\S+).*?verifier=(\S+)", log))
    for (rid, prompt, n, mode, spec), result in zip(work, results):
        if pinned[rid] == lost:
            assert result in (grpc.StatusCode.UNAVAILABLE, hf_greedy(target, prompt, n))
        else:  # survivors: exact tokens, also where the drafter died under them
            assert result == hf_greedy(target, prompt, n), f"{rid} {mode} {spec}"
    assert any(pinned[rid] == lost for rid, *_ in work) and any(pinned[rid] != lost for rid, *_ in work)
    # New requests all go to the surviving replicas and complete.
    fresh = jobs(6, 16, seed=2)
    with ThreadPoolExecutor(6) as pool:
        again = list(pool.map(lambda j: run(replicated, j), fresh))
    for (rid, prompt, n, *_), ids in zip(fresh, again):
        assert ids == hf_greedy(target, prompt, n)
