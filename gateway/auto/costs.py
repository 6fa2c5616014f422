"""Step costs for `--mode auto`: the services' start-up profiles, refined by what the gateway measures.

At start-up each verifier and drafter times its own engine steps over a grid of batch sizes and
shapes (verifier_svc/cost_profile.py, drafter_svc/cost_profile.py) and reports them in
ServiceInfo.step_costs. The profile prices the engine; what the gateway waits for also holds
serialization and Python per sequence and per draft token on three hops, and contention when a
pre-draft shares the GPU with a verify. So every measured round trip feeds a residual model per
role and overlap (measured - profiled ~ theta . [1, B, B x tokens per sequence, profiled], ridge
least squares with exponential forgetting): what is learned at one batch size carries to the
others, where a per-batch factor would start from the bare profile at each new size.
"""

from __future__ import annotations

import bisect
from collections import defaultdict

import numpy as np

from specdec.cost_profile import StepCost


def bucket(batch: int) -> int:
    """Power-of-two batch bucket (the controller re-plans when the batch moves to another)."""
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


class _Residual:
    """measured - profiled seconds ~ theta . x, ridge least squares over decayed sums."""

    def __init__(self, decay: float, ridge: float = 1e-3) -> None:
        self.decay, self.ridge = decay, ridge
        self.gram = np.zeros((4, 4))
        self.rhs = np.zeros(4)
        self.theta = [0.0, 0.0, 0.0, 0.0]
        self.stale = False

    def observe(self, x: tuple, residual: float) -> None:
        v = np.asarray(x)
        self.gram = self.decay * self.gram + np.outer(v, v)
        self.rhs = self.decay * self.rhs + residual * v
        self.stale = True

    def at(self, x: tuple) -> float:
        if self.stale:
            self.theta = np.linalg.solve(self.gram + self.ridge * np.eye(4), self.rhs).tolist()
            self.stale = False
        t = self.theta
        return t[0] * x[0] + t[1] * x[1] + t[2] * x[2] + t[3] * x[3]


def features(batch: int, tokens: int, profiled: float) -> tuple:
    """Scaled to about 1 at batch 64, 16 tokens a sequence, 10 ms."""
    return (1.0, batch / 64, batch * tokens / 1024, profiled * 100)


def shape_tokens(shape: str) -> int:
    """Tokens per sequence a drafter shape drafts or feeds ("chain:4" 4, "pre:4" 9, "tree:4/4/16" 16)."""
    kind, size = shape.split(":")
    if kind == "tree":
        return int(size.split("/")[2])
    return 2 * int(size) + 1 if kind == "pre" else int(size)


class CostModel:
    """Predicted seconds of a verify step (batch, width) and of a draft step (batch, drafter shape)."""

    def __init__(self, verifier: list[StepCost], drafter: list[StepCost], decay: float = 0.995) -> None:
        self.verify_widths: dict[int, _Surface] = {}
        by_width: dict[int, list] = defaultdict(list)
        for c in verifier:
            by_width[int(c.shape.split(":")[1])].append((c.batch, c.seconds))
        self.verify_widths = {w: _Surface(p) for w, p in sorted(by_width.items())}
        by_shape: dict[str, list] = defaultdict(list)
        for c in drafter:
            by_shape[c.shape].append((c.batch, c.seconds))
        self.draft_shapes = {s: _Surface(p) for s, p in by_shape.items()}
        self.residuals = {(role, overlapped): _Residual(decay) for role in ("verify", "draft")
                          for overlapped in (False, True)}

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
        profiled = self.verify_profile(batch, width)
        return self._corrected("verify", overlapped, batch, width - 1, profiled)

    def draft_profile(self, batch: int, shape: str) -> float:
        return self.draft_shapes[shape].at(batch) if batch else 0.0

    def draft(self, batch: int, shape: str, overlapped: bool = False) -> float:
        if not batch:
            return 0.0
        return self._corrected("draft", overlapped, batch, shape_tokens(shape), self.draft_profile(batch, shape))

    def _corrected(self, role: str, overlapped: bool, batch: int, tokens: int, profiled: float) -> float:
        residual = self.residuals[(role, overlapped)].at(features(batch, tokens, profiled))
        return max(profiled + residual, 0.5 * profiled)   # a wild extrapolation must not make a step free

    # ---- what the gateway measured ---------------------------------------------------------------
    def observe_verify(self, batch: int, width: int, seconds: float, overlapped: bool) -> None:
        profiled = self.verify_profile(batch, width)
        self.residuals[("verify", overlapped)].observe(features(batch, width - 1, profiled), seconds - profiled)

    def observe_draft(self, batch: int, shape: str, seconds: float, overlapped: bool) -> None:
        if shape in self.draft_shapes and batch:
            profiled = self.draft_profile(batch, shape)
            self.residuals[("draft", overlapped)].observe(features(batch, shape_tokens(shape), profiled),
                                                          seconds - profiled)
