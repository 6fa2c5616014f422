"""Bad input, cancellation, deadlines and lost backends, through real processes and gRPC."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

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
    return start_cluster(checkpoints["llama-gqa"], checkpoints["llama-gqa/draft"], hold=True)


def held_stream(cluster, rid: str, after: int, req: gateway_pb2.GenerateRequest, timeout: float = 120):
    """Start `req` as `rid`, held after `after` tokens; -> (stream, tokens received up to the hold).
    Nothing more arrives until cluster.release(rid): what follows happens mid-request by construction."""
    cluster.hold(rid, after)
    req.request_id = rid
    stream = cluster.gateway.Generate(req, timeout=timeout)
    ids: list[int] = []
    while len(ids) < after:
        ids += next(stream).token_ids
    return stream, ids


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
    stream, _ = held_stream(cluster, "cancel-me", 2, request([1, 2, 3], 240, "chain", k=2))
    # Held after a verify step: both engines hold the sequence's KV right now.
    assert cluster.info("verifier").active_sequences == 1 and cluster.info("drafter").active_sequences == 1
    stream.cancel()
    wait_idle(cluster)
    cluster.release("cancel-me")


def test_deadline_frees_state_everywhere(cluster):
    stream, got = held_stream(cluster, "deadline", 2, request([9, 8, 7], 240, "tree"), timeout=3)
    assert cluster.info("verifier").active_sequences == 1
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:  # held: the deadline expires mid-request
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(cluster)
    cluster.release("deadline")


def test_lost_drafter_changes_no_token(checkpoints, start_cluster):
    target = checkpoints["llama-gqa"]
    own = start_cluster(target, checkpoints["llama-gqa/draft"], hold=True)
    prompt, n = [3, 1, 4, 1, 5, 9, 2, 6], 200
    stream, ids = held_stream(own, "lose-drafter", 8, request(prompt, n, "chain", k=3))
    assert own.info("drafter").active_sequences == 1  # the drafter holds this sequence's state
    own.kill("drafter")
    own.release("lose-drafter")
    final = None
    for msg in stream:
        ids += msg.token_ids
        if msg.HasField("final"):
            final = msg.final
    assert ids == hf_greedy(target, prompt, n)
    assert final.stats.mode == "off" and final.stats.steps > 0  # it speculated, then fell back
    # New requests still work (mode off while the drafter is gone).
    again, final = own.generate(prompt, 12, "chain")
    assert again == ids[:12] and final.stats.mode == "off"


def test_lost_verifier_not_back_within_the_wait_gives_unavailable(checkpoints, start_cluster):
    own = start_cluster(checkpoints["llama-gqa"], checkpoints["llama-gqa/draft"], hold=True,
                        gateway_extra=["--backend-wait-seconds", "1"])
    stream, _ = held_stream(own, "lose-verifier", 2, request([1, 2, 3], 240, "chain"))
    own.kill("verifier")
    own.release("lose-verifier")
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no verifier replica became available within 1 s" \
        in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        own.generate([1, 2, 3], 5, "off", timeout=30)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_request_resumes_when_its_verifier_is_back(checkpoints, start_cluster):
    """kill -9 of the only verifier mid-request, restarted within --backend-wait-seconds: the
    request resumes from its committed tokens on the new process (which prefills prompt + output
    so far), with exactly the target's tokens; a request sent during the outage waits and succeeds.
    Chain, then tree, on one cluster."""
    target = checkpoints["llama-gqa"]
    own = start_cluster(target, checkpoints["llama-gqa/draft"], hold=True, gateway_extra=["--backend-wait-seconds", "120"])
    for mode, spec in [("chain", {"k": 3}), ("tree", {"topk": 2, "depth": 2, "budget": 4})]:
        prompt, n = [2, 7, 1, 8, 2, 8], 60
        stream, ids = held_stream(own, f"resume-{mode}", 10, request(prompt, n, mode, **spec))
        own.kill("verifier")
        own.release(f"resume-{mode}")   # the next step finds the verifier gone: the request waits
        with ThreadPoolExecutor(1) as pool:
            during = pool.submit(own.generate, [9, 9, 9], 8, mode, **spec)
            time.sleep(0.5)
            own.restart("verifier")
            final = None
            for msg in stream:
                ids += msg.token_ids
                final = msg.final if msg.HasField("final") else final
            assert ids == hf_greedy(target, prompt, n), mode
            assert final.stats.steps > 0
            assert during.result()[0] == hf_greedy(target, [9, 9, 9], 8), mode
        wait_idle(own)


def test_full_queue_gives_resource_exhausted(checkpoints, start_cluster):
    """One KV slot, room for one waiting request: with one request running (held) and one
    waiting, a third gets RESOURCE_EXHAUSTED; the first two then complete exactly."""
    from concurrent.futures import ThreadPoolExecutor

    target = checkpoints["llama-gqa"]
    own = start_cluster(target, None, extra=["--max-sequences", "1"], gateway_extra=["--max-queue", "1"], hold=True)
    running, first = held_stream(own, "running", 1, request([1, 2, 3], 200, "off"))
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(own.generate, [4, 5, 6], 30, "off", request_id="waiting")
        wait_logged(own, "request started", "waiting")  # it is in the queue
        with pytest.raises(grpc.RpcError) as err:
            own.generate([7, 8, 9], 5, "off", request_id="refused")
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting" in err.value.details()
        own.release("running")
        rest = [t for msg in running for t in msg.token_ids]
        assert waiting.result()[0] == hf_greedy(target, [4, 5, 6], 30)
    assert first + rest == hf_greedy(target, [1, 2, 3], 200)


def wait_logged(cluster, event: str, request_id: str, timeout: float = 30.0) -> None:
    log = cluster.log_dir / "gateway.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(event in line and f"request_id={request_id}" in line for line in log.read_text().splitlines()):
            return
        time.sleep(0.05)
    raise AssertionError(f"gateway never logged {event!r} for {request_id}")
