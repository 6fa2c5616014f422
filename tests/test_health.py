"""Health says whether a request can be served now: engines turn SERVING only after their
warm-up, and the gateway follows its verifiers (NOT_SERVING while none is healthy, SERVING
again once one is back)."""

from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from model_factory import hf_greedy

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def wait_health(address: str, status: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (now := health(address)) != status:
        assert time.monotonic() < deadline, f"{address} stayed {now}, expected {status}"
        time.sleep(0.05)


def test_engines_serve_after_a_warm_up_that_leaves_no_trace(checkpoints, start_cluster):
    cluster = start_cluster(checkpoints["llama-gqa"], checkpoints["llama-gqa/draft"])
    for name in ("verifier", "drafter"):
        assert health(cluster.addr[name]) == SERVING
        info = cluster.info(name)
        assert info.active_sequences == 0 and info.sequences_opened == 0, name
        log = (cluster.log_dir / f"{name}.log").read_text()
        # start-up's objects leave the collector's reach before SERVING (specdec.serving.freeze_startup_objects)
        assert log.index("warming up") < log.index("start-up objects frozen") < log.index("ready"), name
        # and malloc keeps large blocks for reuse from then on (specdec/malloc_tuning.py)
        assert log.index("warming up") < log.index("malloc keeps large freed blocks") < log.index("ready"), name
    gateway_log = (cluster.log_dir / "gateway.log").read_text()
    assert "start-up objects frozen" in gateway_log and "malloc keeps large freed blocks" in gateway_log


def test_frozen_start_up_objects_leave_later_garbage_collectable():
    import gc
    import weakref

    from specdec.serving import freeze_startup_objects

    class Cycle:
        pass

    lines = []
    try:
        freeze_startup_objects(type("Log", (), {"info": lambda self, *a, **k: lines.append((a, k))})())
        assert gc.get_freeze_count() > 0 and lines[0][1]["objects"] > 0
        made = Cycle()
        made.me = made   # a cycle: only the collector frees it
        alive = weakref.ref(made)
        del made
        gc.collect()
        assert alive() is None
    finally:
        gc.unfreeze()


def test_gateway_health_follows_its_verifier(checkpoints, start_cluster):
    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, checkpoints["llama-gqa/draft"], gateway_extra=["--resolve-interval", "0.2"])
    gateway = cluster.addr["gateway"]
    assert health(gateway) == SERVING
    cluster.kill("verifier")
    wait_health(gateway, NOT_SERVING)
    cluster.restart("verifier")
    wait_health(gateway, SERVING)
    ids, _ = cluster.generate([5, 6, 7], 8, "chain")
    assert ids == hf_greedy(target, [5, 6, 7], 8)
