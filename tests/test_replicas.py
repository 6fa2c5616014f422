"""Two verifiers and two drafters behind one gateway: requests spread over both replicas of
each service, outputs stay exact, and losing one replica of each loses no request: those on the
lost verifier resume on the other from their committed tokens, those whose drafter died finish in
mode off, all with exactly the target's tokens; the survivors take new requests."""

from __future__ import annotations

import re
import threading
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


def run(cluster, job, held: threading.Barrier | None = None) -> tuple[list[int] | grpc.StatusCode, str]:
    """-> (tokens, or the status it failed with; the mode it finished in). With `held`, waits at
    the barrier once the request has reached its hold (see run_held) and then reads on."""
    rid, prompt, n, mode, spec = job
    req = request(prompt, n, mode, **spec)
    req.request_id = rid
    ids, final_mode = [], ""
    try:
        for msg in cluster.gateway.Generate(req, timeout=120):
            ids += msg.token_ids
            if held is not None and len(ids) >= HOLD_AT:
                held.wait(timeout=120)
                held = None
            if msg.HasField("final"):
                final_mode = msg.final.stats.mode
    except grpc.RpcError as exc:
        return exc.code(), final_mode
    return ids, final_mode


HOLD_AT = 2  # tokens: the prefill's, then at least one verify step (so drafters hold state too)


def run_held(cluster, work, while_held=lambda: None) -> list[tuple[list[int] | grpc.StatusCode, str]]:
    """Run all jobs concurrently; once every one of them is pinned, running and held after
    HOLD_AT tokens, call `while_held`, then release them all. Deterministic at any step speed."""
    for rid, *_ in work:
        cluster.hold(rid, HOLD_AT)
    barrier = threading.Barrier(len(work) + 1)
    with ThreadPoolExecutor(len(work)) as pool:
        futures = [pool.submit(run, cluster, j, barrier) for j in work]
        barrier.wait(timeout=120)
        while_held()
        for rid, *_ in work:
            cluster.release(rid)
        return [f.result() for f in futures]


@pytest.fixture
def replicated(checkpoints, start_cluster):
    cluster = start_cluster(checkpoints["llama-gqa"], checkpoints["llama-gqa/draft"], verifiers=2, drafters=2,
                            gateway_extra=["--resolve-interval", "0.5"], hold=True)
    wait_all_healthy(cluster)
    return cluster


def wait_all_healthy(cluster, timeout: float = 60.0) -> None:
    """The gateway serves once one verifier and one drafter answer; the tests pin requests over
    all four replicas, so wait until its log shows every one healthy (under load the second of a
    pair can come a few health rounds later)."""
    addresses = {a for name, a in cluster.addr.items() if name != "gateway"}
    deadline = time.monotonic() + timeout
    while True:
        log = (cluster.log_dir / "gateway.log").read_text()
        seen = set(re.findall(r"replica healthy.*?address=(\S+)", log))
        if addresses <= seen:
            return
        assert time.monotonic() < deadline, f"replicas never healthy in the gateway: {addresses - seen}"
        time.sleep(0.1)


def pins(cluster) -> dict[str, tuple[str, str]]:
    """request id -> (verifier, drafter) it was pinned to, from the gateway's log."""
    log = (cluster.log_dir / "gateway.log").read_text()
    return {rid: (v, d) for d, rid, v in re.findall(
        r"request started.*?drafter=(\S+).*?request_id=(\S+).*?verifier=(\S+)", log)}


def test_sixteen_requests_spread_over_both_replicas(replicated, checkpoints):
    target = checkpoints["llama-gqa"]
    work = jobs(16, 24)
    results = run_held(replicated, work)  # all 16 are running at once: least-loaded spreads them
    for (rid, prompt, n, mode, spec), (ids, _) in zip(work, results):
        assert ids == hf_greedy(target, prompt, n), f"{rid} {mode} {spec}"
    for name in ("verifier", "verifier.1", "drafter", "drafter.1"):
        assert replicated.info(name).sequences_opened > 0, f"{name} carried no request"


def test_losing_one_replica_of_each(replicated, checkpoints):
    target = checkpoints["llama-gqa"]
    work = jobs(12, 200, seed=1)

    killed = []

    def kill_one_of_each():
        """verifier.1, and a drafter that requests on the surviving verifier use: the pairs are
        pinned independently, and least-loaded ties can pair the replicas one to one (v0 with d0,
        v1 with d1), so killing a fixed drafter may leave no survivor without its drafter."""
        replicated.kill("verifier.1")
        under_survivor = {d for v, d in pins(replicated).values() if v == replicated.addr["verifier"]}
        killed.append(next(n for n in ("drafter", "drafter.1") if replicated.addr[n] in under_survivor))
        replicated.kill(killed[0])

    results = run_held(replicated, work, kill_one_of_each)
    lost_v, lost_d = replicated.addr["verifier.1"], replicated.addr[killed[0]]
    pinned = pins(replicated)
    drafter_died_under_survivor = 0
    for (rid, prompt, n, mode, spec), (result, final_mode) in zip(work, results):
        verifier, drafter = pinned[rid]
        # exact tokens everywhere: resumed on the surviving verifier, or where the drafter died under them
        assert result == hf_greedy(target, prompt, n), f"{rid} {mode} {spec} (first on {verifier})"
        if verifier != lost_v:
            if drafter == lost_d and mode != "off":
                assert final_mode == "off", f"{rid} kept speculating without its drafter"
                drafter_died_under_survivor += 1
    assert drafter_died_under_survivor > 0, pinned
    assert {v for v, _ in pinned.values()} == {lost_v, replicated.addr["verifier"]}
    # New requests all go to the surviving replicas and complete.
    fresh = jobs(6, 16, seed=2)
    with ThreadPoolExecutor(6) as pool:
        again = list(pool.map(lambda j: run(replicated, j), fresh))
    for (rid, prompt, n, *_), (ids, _) in zip(fresh, again):
        assert ids == hf_greedy(target, prompt, n)
