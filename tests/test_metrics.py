"""Prometheus metrics on every service (--metrics-listen): after real traffic the gateway's counters
match what the clients received (requests by status, tokens, TTFT/TPOT counts, acceptance per
position, overlap, auto's choices, the step split), and the engines report their steps and give
their KV slots back."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from cluster import free_port, request
from prometheus_client.parser import text_string_to_metric_families

from specdec.rpc import gateway_pb2


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_follow_the_traffic(checkpoints, start_cluster):
    ports = {name: free_port() for name in ("gateway", "verifier", "drafter")}
    target = checkpoints["llama-gqa"]
    listen = {name: ["--metrics-listen", f"127.0.0.1:{port}"] for name, port in ports.items()}
    cluster = start_cluster(target, target, verifier_extra=listen["verifier"], drafter_extra=listen["drafter"],
                            gateway_extra=listen["gateway"])
    jobs = [([1, 17, 42], 20, "chain", {"k": 4}), ([5, 6, 7, 8], 12, "off", {}), ([9, 3], 16, "auto", {})]
    tokens = 0
    for prompt, n, mode, spec in jobs:
        ids, _ = cluster.generate(prompt, n, mode, **spec)
        tokens += len(ids)
    bad = request([1, 2], 4, "chain", k=999)
    with pytest.raises(grpc.RpcError):
        list(cluster.gateway.Generate(bad, timeout=30))

    g = scrape(ports["gateway"])
    assert value(g, "specdec_gateway_requests_total", status="OK") == 3
    assert value(g, "specdec_gateway_requests_total", status="INVALID_ARGUMENT") == 1
    assert value(g, "specdec_gateway_completion_tokens_total") == tokens
    assert value(g, "specdec_gateway_prompt_tokens_total") == 3 + 4 + 2
    assert value(g, "specdec_gateway_ttft_seconds_count") == 3 and value(g, "specdec_gateway_tpot_seconds_count") == 3
    # self-drafted: every chain position is accepted, so tried == accepted at position 1..4
    tried = value(g, "specdec_gateway_draft_positions_total", position="1", outcome="tried")
    assert tried > 0 and value(g, "specdec_gateway_draft_positions_total", position="1", outcome="accepted") == tried
    assert value(g, "specdec_gateway_overlap_predrafts_total", outcome="hit") > 0
    assert value(g, "specdec_gateway_accepted_tokens_per_step_count") > 0
    assert sum(v for (name, _), v in g.items() if name == "specdec_gateway_auto_steps_total") > 0
    for part in ("step", "verify_engine", "draft_engine", "transport", "gateway", "draft", "predraft",
                 "predraft_exposed"):
        assert value(g, "specdec_gateway_step_seconds_count", part=part) > 0, part
    # a pre-draft waited on after the verdict is at most the pre-draft's whole round trip
    assert 0 < value(g, "specdec_gateway_step_seconds_sum", part="predraft")
    assert value(g, "specdec_gateway_step_seconds_sum", part="predraft_exposed") <= \
        value(g, "specdec_gateway_step_seconds_sum", part="predraft")

    for role in ("verifier", "drafter"):
        e = scrape(ports[role])
        assert value(e, "specdec_engine_step_seconds_count", role=role) > 0, role
        assert value(e, "specdec_engine_sequences_opened_total", role=role) >= 2, role
        assert value(e, "specdec_engine_kv_slots", role=role, state="in_use") == 0, role   # all given back
        assert value(e, "specdec_engine_kv_slots", role=role, state="total") > 0, role
