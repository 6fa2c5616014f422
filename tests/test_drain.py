"""Graceful drain on SIGTERM: the gateway and the engines turn NOT_SERVING, the gateway refuses new
requests with UNAVAILABLE, a request in flight still finishes with exactly the target's tokens
(the engines keep stepping it), and then every process exits 0. A drain period that runs out
cuts what is left and exits anyway."""

from __future__ import annotations

import signal
import time

import grpc
import pytest
from cluster import request
from model_factory import hf_greedy
from test_e2e_failures import held_stream
from test_health import NOT_SERVING, health

from specdec.rpc import gateway_pb2


def test_sigterm_drains_in_flight_requests_then_exits(checkpoints, start_cluster):
    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, checkpoints["llama-gqa/draft"], hold=True, extra=["--drain-seconds", "60"],
                            gateway_extra=["--drain-seconds", "60"])
    stream, got = held_stream(cluster, "in-flight", 3, request([1, 17, 42], 20, "chain", k=3))
    for name in ("gateway", "verifier", "drafter"):
        cluster.procs[name].send_signal(signal.SIGTERM)
    for name in ("gateway", "verifier", "drafter"):
        deadline = time.monotonic() + 10
        while health(cluster.addr[name]) != NOT_SERVING:
            assert time.monotonic() < deadline, name
            time.sleep(0.05)
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.gateway.Generate(request([5, 6], 4, "off"), timeout=10))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.value.details()
    assert all(cluster.procs[n].poll() is None for n in ("gateway", "verifier", "drafter"))   # still draining
    cluster.release("in-flight")
    final = None
    for msg in stream:
        got += list(msg.token_ids)
        final = msg.final if msg.HasField("final") else final
    assert got == hf_greedy(target, [1, 17, 42], 20) and final.finish_reason == "length"
    for name in ("gateway", "verifier", "drafter"):
        assert cluster.procs[name].wait(timeout=20) == 0, name


def test_a_drain_period_that_runs_out_cuts_the_rest(checkpoints, start_cluster):
    cluster = start_cluster(checkpoints["llama-gqa"], checkpoints["llama-gqa/draft"], hold=True,
                            gateway_extra=["--drain-seconds", "0.5"])
    stream, _ = held_stream(cluster, "stuck", 2, request([3, 4, 5], 50, "off"))
    cluster.procs["gateway"].send_signal(signal.SIGTERM)
    assert cluster.procs["gateway"].wait(timeout=20) == 0   # held forever: cut off after 0.5 s
    with pytest.raises(grpc.RpcError):
        for _ in stream:
            pass
    assert "drain period over; 1 requests cut off" in (cluster.log_dir / "gateway.log").read_text()
    _ = gateway_pb2
