"""Prometheus metrics: the HTTP endpoint (`--metrics-listen HOST:PORT`, env SPECDEC_METRICS_LISTEN) and
the engines' metrics. Each service is its own process with prometheus_client's default registry;
the gateway's metrics live in gateway/metrics.py. Buckets are in seconds and tokens."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0, 4.0)

ENGINE_STEP = Histogram("specdec_engine_step_seconds", "Engine time per step (one batched call)", ["role"],
                        buckets=STEP_BUCKETS)
ENGINE_ACTIVE = Gauge("specdec_engine_active_sequences", "Sequences holding KV state", ["role"])
ENGINE_KV_SLOTS = Gauge("specdec_engine_kv_slots", "KV cache slots (one per sequence), in use and in total",
                        ["role", "state"])
ENGINE_KV_BYTES = Gauge("specdec_engine_kv_bytes_in_use", "KV cache memory of the slots in use", ["role"])
ENGINE_OPENED = Counter("specdec_engine_sequences_opened_total", "Sequences opened", ["role"])
ENGINE_STREAMS = Gauge("specdec_engine_open_streams", "Open step streams (gateways)", ["role"])


def start_metrics(listen: str, log) -> None:
    """Serve /metrics at HOST:PORT (nothing when empty)."""
    if listen:
        host, _, port = listen.rpartition(":")
        if not port.isdigit():
            raise SystemExit(f"--metrics-listen takes HOST:PORT, not {listen!r}")
        start_http_server(int(port), addr=host or "0.0.0.0")
        log.info("metrics", address=listen, path="/metrics")


class EngineMetrics:
    """Updates the engine gauges after each step (cheap: host counters only; the labelled series
    are looked up once, and the gauges are set only when the count moved)."""

    def __init__(self, role: str, engine) -> None:
        self.engine = engine
        self.slot_bytes = kv_slot_bytes(engine)
        self.opened = engine.table.opened
        self.active = -1
        self.step = ENGINE_STEP.labels(role)
        self.active_gauge, self.slots_in_use = ENGINE_ACTIVE.labels(role), ENGINE_KV_SLOTS.labels(role, "in_use")
        self.kv_bytes, self.opened_total = ENGINE_KV_BYTES.labels(role), ENGINE_OPENED.labels(role)
        ENGINE_KV_SLOTS.labels(role, "total").set(engine.table.num_slots)
        self.refresh()

    def after_step(self, seconds: float) -> None:
        self.step.observe(seconds)
        self.refresh()

    def refresh(self) -> None:
        active = len(self.engine.table)
        if active != self.active:
            self.active = active
            self.active_gauge.set(active)
            self.slots_in_use.set(active)
            self.kv_bytes.set(active * self.slot_bytes)
        opened = self.engine.table.opened
        if opened > self.opened:
            self.opened_total.inc(opened - self.opened)
        self.opened = opened


def kv_slot_bytes(engine) -> int:
    """Bytes of one sequence's KV slot on this process (a tensor-parallel rank holds its heads)."""
    cache = getattr(engine, "cache", None) or getattr(getattr(engine, "runner", None), "cache", None)
    if cache is None:
        return 0
    return (cache.k.numel() + cache.v.numel()) * cache.k.element_size() // cache.num_slots
