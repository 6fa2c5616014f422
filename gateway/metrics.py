"""The gateway's Prometheus metrics (served with `--metrics-listen`, specdec/metrics.py).

Requests by final gRPC status; prompt and completion tokens; time to first token and time per
output token (per sample); per verifier: queue depth and active sequences; each step's time split
into the drafter's and verifier's engine time, transport (their round trips less engine time) and
the gateway (the rest of the step); accepted tokens per verify step, draft positions tried and
accepted (their ratio is the acceptance per position), overlap pre-drafts used or dropped, and
auto's choices."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from specdec.metrics import STEP_BUCKETS

REQUESTS = Counter("specdec_gateway_requests_total", "Finished requests by gRPC status", ["status"])
PROMPT_TOKENS = Counter("specdec_gateway_prompt_tokens_total", "Prompt tokens of admitted requests")
COMPLETION_TOKENS = Counter("specdec_gateway_completion_tokens_total", "Tokens streamed to clients")
TTFT = Histogram("specdec_gateway_ttft_seconds", "Request start to a sample's first token",
                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0))
TPOT = Histogram("specdec_gateway_tpot_seconds", "A sample's time per output token after the first",
                 buckets=(0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0))
QUEUE = Gauge("specdec_gateway_queue_depth", "Requests waiting for a KV slot", ["verifier"])
ACTIVE = Gauge("specdec_gateway_active_sequences", "Sequences in the step loop", ["verifier"])
STEP = Histogram("specdec_gateway_step_seconds", "Step time split: step (the whole), draft_engine, verify_engine, "
                 "transport (round trips less engine time), gateway (the step less its waits); and the drafter's "
                 "round trips: draft (before the verify, on the step's path), predraft (overlap's, beside the "
                 "verify), predraft_exposed (what the step waited for a pre-draft after its verdict)", ["part"],
                 buckets=STEP_BUCKETS)
ACCEPTED = Histogram("specdec_gateway_accepted_tokens_per_step", "Tokens a verify step committed (bonus included)",
                     buckets=tuple(range(1, 18)))
POSITION = Counter("specdec_gateway_draft_positions_total", "Draft positions tried and accepted "
                   "(accepted / tried per position is the acceptance per draft position)", ["position", "outcome"])
OVERLAP = Counter("specdec_gateway_overlap_predrafts_total", "Overlap pre-drafts used (hit) or dropped (miss)",
                  ["outcome"])
AUTO_STEPS = Counter("specdec_gateway_auto_steps_total", "Sequence steps run by each --mode auto choice", ["choice"])


STEP_PARTS = ("step", "draft_engine", "verify_engine", "transport", "gateway", "draft", "predraft", "predraft_exposed")


class StepTally:
    """One step's per-sequence counts, added to the counters once per step (label lookups are
    resolved once here: per-sequence calls would cost the hot path ~0.5 ms at batch 64)."""

    POSITIONS = 16

    def __init__(self, verifier: str) -> None:
        self.queue, self.active = QUEUE.labels(verifier), ACTIVE.labels(verifier)
        self.tried_c = [POSITION.labels(str(i + 1), "tried") for i in range(self.POSITIONS)]
        self.accepted_c = [POSITION.labels(str(i + 1), "accepted") for i in range(self.POSITIONS)]
        self.hit_c, self.miss_c = OVERLAP.labels("hit"), OVERLAP.labels("miss")
        self.parts = {p: STEP.labels(p) for p in STEP_PARTS}
        self.reset()

    def reset(self) -> None:
        self.tried = [0] * self.POSITIONS
        self.accepted = [0] * self.POSITIONS
        self.hits = self.misses = 0
        self.choices: dict[str, int] = {}

    def verdict(self, drafted_depth: int, accepted: int, committed: int) -> None:
        ACCEPTED.observe(committed)
        for i in range(min(accepted + 1, drafted_depth, self.POSITIONS)):
            self.tried[i] += 1
        for i in range(min(accepted, self.POSITIONS)):
            self.accepted[i] += 1

    def flush(self, step: float, waited: float, verify: tuple[float, float], draft: tuple[float, float],
              predraft: float = 0.0) -> None:
        """step: the whole step's seconds; waited: what it waited for backends; verify, draft:
        (round trip, engine seconds) of the verify call and of the sync draft calls; predraft: the
        round trip of overlap's pre-draft calls, sent with the verify."""
        for i in range(self.POSITIONS):
            if self.tried[i]:
                self.tried_c[i].inc(self.tried[i])
            if self.accepted[i]:
                self.accepted_c[i].inc(self.accepted[i])
        if self.hits:
            self.hit_c.inc(self.hits)
        if self.misses:
            self.miss_c.inc(self.misses)
        for choice, n in self.choices.items():
            AUTO_STEPS.labels(choice).inc(n)
        parts = self.parts
        parts["step"].observe(step)
        parts["verify_engine"].observe(verify[1])
        if draft[0]:
            parts["draft_engine"].observe(draft[1])
            parts["draft"].observe(draft[0])
        if predraft:   # hidden by the verify but for what outlasted it
            parts["predraft"].observe(predraft)
            parts["predraft_exposed"].observe(max(0.0, predraft - verify[0]))
        parts["transport"].observe(max(0.0, verify[0] - verify[1]) + max(0.0, draft[0] - draft[1]))
        parts["gateway"].observe(max(0.0, step - waited))
        self.reset()
