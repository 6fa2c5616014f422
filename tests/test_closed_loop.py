"""The benchmarks' load generator: C clients in a closed loop (each sends its next request as soon as
its last one ended) keep exactly C requests in flight until the prompts run out, and hand back the
traces in prompt order; with one prompt per client it is a single wave started together. The sweep
runs the waves of one concurrency's cells in turn."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/ is not an installed package

from benchmarks import gateway_runs  # noqa: E402
from benchmarks.grid import CONFIGS  # noqa: E402
from benchmarks.metrics import SeqTrace  # noqa: E402


@pytest.mark.parametrize("clients, prompts", [(3, 10), (4, 4)])
def test_clients_keep_their_concurrency_and_traces_follow_the_prompts(monkeypatch, clients, prompts):
    in_flight, peak, started = 0, 0, []

    async def one(stub, prompt, max_new, cfg):
        nonlocal in_flight, peak
        if max_new == 2:      # the warm-up: one short request per client
            return SeqTrace(0.0)
        in_flight += 1
        peak = max(peak, in_flight)
        started.append(prompt[0])
        await asyncio.sleep(0.001 * (1 + prompt[0] % 3))   # requests of unequal lengths
        in_flight -= 1
        trace = SeqTrace(0.0)
        trace.tokens = list(prompt)
        return trace

    monkeypatch.setattr(gateway_runs.GatewayClient, "_one", staticmethod(one))
    client = gateway_runs.GatewayClient()
    try:
        traces = client.run("127.0.0.1:1", [[i] for i in range(prompts)], 8, CONFIGS["off"], warmup_tokens=2,
                            clients=clients)
    finally:
        client.close()
    assert [t.tokens for t in traces] == [[i] for i in range(prompts)]
    assert peak == clients and sorted(started) == list(range(prompts))
    assert set(started[:clients]) == set(range(clients))    # each client starts with its own first prompt


def test_the_cells_are_grouped_by_concurrency_for_their_waves_in_turn():
    """Drift in the machine's speed must fall on every mode of a C alike: the cells are grouped by
    C (mode off first, as they came), and each group runs wave 1 of every cell, then wave 2, ..."""
    from benchmarks.grid import _cells, _ordered
    from benchmarks.run import rotation

    cells = _ordered(_cells([0.0, 0.8], [1, 4], ["off", "chain k=2", "auto"]))
    groups = rotation(cells)
    assert [{c.concurrency for c in g} for g in groups] == [{1}, {4}]
    assert all(g[0].config.name == "off" and len(g) == 5 for g in groups)   # off once, then 2 a x 2 modes
    assert {c for g in groups for c in g} == set(cells)
