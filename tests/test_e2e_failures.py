"""Bad input, cancellation, deadlines and lost backends, through real processes and gRPC."""

from __future__ import annotations

import time

import grpc
import pytest
from cluster import request
from model_factory import hf_greedy

from specdec.rpc import gateway_pb2


def wait_idle(cluster, names=("verifier", "drafter"), timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(cluster.info(n).active_sequences == 0 for n in names):
            return
        time.sleep(0.1)
    raise AssertionError({n: cluster.info(n).active_sequences for n in names})


@pytest.fixture(scope="module")
def cluster(checkpoints, start_cluster):
    return start_cluster(checkpoints["llama-gqa"], checkpoints["llama-gqa/draft"])


@pytest.mark.parametrize("req, fix_hint", [
    (gateway_pb2.GenerateRequest(max_new_tokens=4), "prompt is empty"),
    (gateway_pb2.GenerateRequest(text="", max_new_tokens=4), "prompt is empty"),
    (request([1, 2, 384], 4), "outside the vocabulary"),
    (request([1, 2, -1], 4), "outside the vocabulary"),
    (request([1, 2, 3], 4, "chain", k=17), "k=17 is out of range"),
    (request([1, 2, 3], 4, "tree", budget=65), "budget=65 is out of range"),
    (request([1, 2, 3], 4, "tree", topk=9), "topk=9 is out of range"),
    (request([1, 2, 3], 300), "exceeds the context limit"),
    (gateway_pb2.GenerateRequest(text="hi", stop=[""]), "non-empty strings"),
])
def test_invalid_requests_get_invalid_argument(cluster, req, fix_hint):
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.gateway.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert fix_hint in err.value.details()


def test_service_keeps_serving_after_bad_input(cluster, checkpoints):
    ids, _ = cluster.generate([5, 6, 7], 10, "chain")
    assert ids == hf_greedy(checkpoints["llama-gqa"], [5, 6, 7], 10)


def test_client_cancel_frees_state_everywhere(cluster):
    stream = cluster.gateway.Generate(request([1, 2, 3], 240, "chain", k=2), timeout=60)
    got = next(stream)
    assert got.token_ids
    stream.cancel()
    wait_idle(cluster)


def test_deadline_frees_state_everywhere(cluster):
    with pytest.raises(grpc.RpcError) as err:
        for _ in cluster.gateway.Generate(request([9, 8, 7], 240, "tree"), timeout=0.5):
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(cluster)


def test_lost_drafter_changes_no_token(checkpoints, start_cluster):
    target = checkpoints["llama-gqa"]
    own = start_cluster(target, checkpoints["llama-gqa/draft"])
    prompt, n = [3, 1, 4, 1, 5, 9, 2, 6], 200
    ids = []
    final = None
    for i, msg in enumerate(own.gateway.Generate(request(prompt, n, "chain", k=3), timeout=120)):
        ids += msg.token_ids
        if i == 2:
            own.kill("drafter")
        if msg.HasField("final"):
            final = msg.final
    assert ids == hf_greedy(target, prompt, n)
    assert final.stats.mode == "off"
    # New requests still work (mode off while the drafter is gone).
    again, final = own.generate(prompt, 12, "chain")
    assert again == ids[:12] and final.stats.mode == "off"


def test_lost_verifier_gives_unavailable(checkpoints, start_cluster):
    own = start_cluster(checkpoints["llama-gqa"], checkpoints["llama-gqa/draft"])
    with pytest.raises(grpc.RpcError) as err:
        for i, _ in enumerate(own.gateway.Generate(request([1, 2, 3], 240, "chain"), timeout=60)):
            if i == 1:
                own.kill("verifier")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as err:
        own.generate([1, 2, 3], 5, "off", timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_full_queue_gives_resource_exhausted(checkpoints, start_cluster):
    """One KV slot, room for one waiting request: of three long concurrent requests, the one
    that finds the queue full gets RESOURCE_EXHAUSTED and the others complete."""
    from concurrent.futures import ThreadPoolExecutor

    own = start_cluster(checkpoints["llama-gqa"], None, extra=["--max-sequences", "1"],
                        gateway_extra=["--max-queue", "1"])

    def call(_):
        try:
            return own.generate([1, 2, 3], 200, "off")[0]
        except grpc.RpcError as exc:
            return exc.code()

    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(call, range(3)))
    assert grpc.StatusCode.RESOURCE_EXHAUSTED in results
    assert any(isinstance(r, list) and len(r) == 200 for r in results)
