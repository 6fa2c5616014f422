"""Step costs for `--mode auto`: the services' start-up profiles, refined by what the gateway measures.

At start-up each verifier and drafter times its own engine steps over a grid of batch sizes and
shapes (verifier_svc/cost_profile.py, drafter_svc/cost_profile.py) and reports them in
ServiceInfo.step_costs. The profile prices the engine; what the gateway waits for also holds
serialization, transport and contention when a pre-draft shares the GPU with a verify. So every
step's measured round trip updates a correction factor (an EWMA of measured / profiled) per role,
batch bucket and whether the step overlapped, and predictions are profile x correction.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

from specdec.cost_profile import StepCost


def bucket(batch: int) -> int:
    """Corrections are kept per power-of-two batch bucket."""
    return 1 << max(0, batch - 1).bit_length()


class _Surface:
    """One shape's seconds over batch sizes, linearly interpolated (and extrapolated at the top).
    Plain Python: called a few hundred times a step, where numpy's per-call overhead would show."""

    def __init__(self, points: list[tuple[int, float]]) -> None:
        points = sorted(points)
        self.batch = [float(b) for b, _ in points]
        self.seconds = [s for _, s in points]

    def at(self, batch: int) -> float:
        xs, ys = self.batch, self.seconds
        if len(xs) == 1:
            return ys[0] * batch / xs[0] if batch > xs[0] else ys[0]
        if batch <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_left(xs, batch), len(xs) - 1)   # beyond the profile: the last segment's slope
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (batch - x0) / (x1 - x0)


@dataclass
class _Ratio:
    value: float = 1.0
    n: int = 0

    def update(self, ratio: float, alpha: float) -> None:
        ratio = min(max(ratio, 0.2), 20.0)   # one stalled step (a GC pause, a reconnect) must not swing it
        self.value = ratio if self.n == 0 else (1 - alpha) * self.value + alpha * ratio
        self.n += 1


class CostModel:
    """Predicted seconds of a verify step (batch, width) and of a draft step (batch, drafter shape)."""

    def __init__(self, verifier: list[StepCost], drafter: list[StepCost], alpha: float = 0.1) -> None:
        self.alpha = alpha
        self.verify_widths: dict[int, _Surface] = {}
        by_width: dict[int, list] = defaultdict(list)
        for c in verifier:
            by_width[int(c.shape.split(":")[1])].append((c.batch, c.seconds))
        self.verify_widths = {w: _Surface(p) for w, p in sorted(by_width.items())}
        by_shape: dict[str, list] = defaultdict(list)
        for c in drafter:
            by_shape[c.shape].append((c.batch, c.seconds))
        self.draft_shapes = {s: _Surface(p) for s, p in by_shape.items()}
        self.corrections: dict[tuple, _Ratio] = defaultdict(_Ratio)

    @property
    def complete(self) -> bool:
        return bool(self.verify_widths) and bool(self.draft_shapes)

    def has_draft_shape(self, shape: str) -> bool:
        return shape in self.draft_shapes

    # ---- predictions ---------------------------------------------------------------------------
    def verify_profile(self, batch: int, width: int) -> float:
        widths = list(self.verify_widths)
        if width in self.verify_widths:
            return self.verify_widths[width].at(batch)
        lo = max((w for w in widths if w < width), default=widths[0])
        hi = min((w for w in widths if w > width), default=widths[-1])
        a, b = self.verify_widths[lo].at(batch), self.verify_widths[hi].at(batch)
        return a if hi == lo else a + (b - a) * (width - lo) / (hi - lo)

    def verify(self, batch: int, width: int, overlapped: bool = False) -> float:
        return self.verify_profile(batch, width) * self.corrections[("verify", bucket(batch), overlapped)].value

    def draft_profile(self, batch: int, shape: str) -> float:
        return self.draft_shapes[shape].at(batch) if batch else 0.0

    def draft(self, batch: int, shape: str, overlapped: bool = False) -> float:
        if not batch:
            return 0.0
        return self.draft_profile(batch, shape) * self.corrections[("draft", bucket(batch), overlapped)].value

    # ---- what the gateway measured ---------------------------------------------------------------
    def observe_verify(self, batch: int, width: int, seconds: float, overlapped: bool) -> None:
        predicted = self.verify_profile(batch, width)
        if predicted > 0:
            self.corrections[("verify", bucket(batch), overlapped)].update(seconds / predicted, self.alpha)

    def observe_draft(self, batch: int, shape: str, seconds: float, overlapped: bool) -> None:
        if shape in self.draft_shapes and batch:
            predicted = self.draft_profile(batch, shape)
            if predicted > 0:
                self.corrections[("draft", bucket(batch), overlapped)].update(seconds / predicted, self.alpha)
