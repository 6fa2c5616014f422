"""The gateway's step split over one measured wave, read from its Prometheus metrics (--metrics-listen):
the whole step, the verifier's and the synchronous drafts' engine times, the transport (round trips
less engine time), the gateway's own share (the step less its waits), the drafter's round trips
before the verify (on the step's path) and beside it (overlap's pre-drafts), what a step still
waited for a pre-draft after its verdict, and from those the share of drafter time that overlap
hid: (predraft - predraft_exposed) / (draft + predraft)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

PARTS = ("step", "verify_engine", "draft_engine", "transport", "gateway", "draft", "predraft", "predraft_exposed")
Snapshot = dict[str, tuple[float, float]]   # part -> (seconds summed, observations)


def scrape(address: str) -> Snapshot:
    """address: the gateway's HOST:PORT for /metrics."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != "specdec_gateway_step_seconds":
            continue
        for s in family.samples:
            part = s.labels.get("part")
            if s.name.endswith("_sum"):
                sums[part] = s.value
            elif s.name.endswith("_count"):
                counts[part] = s.value
    return {p: (sums.get(p, 0.0), counts.get(p, 0.0)) for p in PARTS}


def split(before: Snapshot, after: Snapshot) -> dict[str, float | None]:
    """Per gateway step between the snapshots (ms), and the share of drafter time hidden (None
    where nothing was drafted)."""
    steps = after["step"][1] - before["step"][1]
    if steps <= 0:
        return {}
    seconds = {p: after[p][0] - before[p][0] for p in PARTS}
    drafter = seconds["draft"] + seconds["predraft"]
    return {"loop_step_ms": 1e3 * seconds["step"] / steps, "verify_ms": 1e3 * seconds["verify_engine"] / steps,
            "draft_engine_ms": 1e3 * seconds["draft_engine"] / steps,
            "transport_ms": 1e3 * seconds["transport"] / steps, "gateway_ms": 1e3 * seconds["gateway"] / steps,
            "draft_ms": 1e3 * seconds["draft"] / steps, "predraft_ms": 1e3 * seconds["predraft"] / steps,
            "predraft_exposed_ms": 1e3 * seconds["predraft_exposed"] / steps,
            "overlap_hidden": (seconds["predraft"] - seconds["predraft_exposed"]) / drafter if drafter > 0 else None}
