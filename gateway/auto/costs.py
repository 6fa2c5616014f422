"""Step costs for `--mode auto`: the services' start-up profiles, calibrated by measured whole steps.

At start-up each verifier and drafter times its own engine steps over a grid of batch sizes and
shapes (verifier_svc/cost_profile.py, drafter_svc/cost_profile.py) and reports them in
ServiceInfo.step_costs; `CostModel` interpolates them. The profile prices the engines only: what
a step really takes also holds serialization and Python on three hops, and contention when a
drafter shares the GPU with the verifier. `StepCalibration` learns the difference from the
gateway's own clock: whole steps measured against the model, per choice and batch size.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict, deque

import numpy as np

from specdec.cost_profile import StepCost


def bucket(batch: int) -> int:
    """Power-of-two batch bucket (the controller re-plans when the batch moves to another)."""
    return 1 << max(0, batch - 1).bit_length()


def nearest_first(buckets, b: int) -> list[int]:
    """Buckets ordered by their distance from bucket b in powers of two, the smaller first on a tie."""
    return sorted(buckets, key=lambda x: (abs(x.bit_length() - b.bit_length()), x))


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


class StepCalibration:
    """measured / modelled whole-step time per choice and batch bucket. Robust to a stalled step
    (a connection set up, a GC pause): the median of the last few, or while fewer than three were
    measured their least. A (choice, bucket) not measured yet is estimated from its neighbours:
    the closest choice of its kind (by verify width) measured at this bucket; else its own (or,
    failing that, its kind's closest) figure at the nearest measured bucket, scaled by how the
    choices measured at both buckets changed between them (costs the profile misses, like
    contention on a shared GPU, can grow with the batch: a small batch's figure alone would make
    every choice look good at a large one, and each would be tried in turn); with nothing to go
    on it is the bare model, so the choice gets tried once and measured.

    A step that also did one-off work (a drafter catching up after steps without drafts, the rows
    the verifier held while requests ran off) is only an upper bound on its choice's steps: it caps
    the estimate until a clean step measures the choice at that bucket, and is never borrowed. Read
    as a measurement, the first step of chain k=2 after a spell off at C = 64 (28 ms, its clean
    steps ~20) priced it and its kin chain k=4 at 37 ms (~31) for the rest of the run, and auto
    stayed off where chain k=4 ran 1.08x of off (H100, 8B)."""

    def __init__(self, window: int = 5, plain_kind: str = "off") -> None:
        """plain_kind: the kind of steps that only verify (mode off)."""
        self.window, self.plain_kind = window, plain_kind
        self.samples: dict[tuple[str, int], deque] = {}          # (choice name, bucket) -> ratios
        self.kinds: dict[str, dict[int, set[str]]] = {}          # kind -> width -> measured choice names
        self.bounds: dict[tuple[str, int], float] = {}           # (choice name, bucket) -> least bounding ratio

    def observe(self, kind: str, name: str, width: int, batch: int, measured: float, modelled: float,
                bound: bool = False) -> None:
        """bound: the step also did one-off work; its ratio only bounds the choice's from above."""
        if modelled > 0 and measured > 0:
            key = (name, bucket(batch))
            if bound:
                self.bounds[key] = min(self.bounds.get(key, float("inf")), measured / modelled)
                return
            self.samples.setdefault(key, deque(maxlen=self.window)).append(measured / modelled)
            self.kinds.setdefault(kind, {}).setdefault(width, set()).add(name)

    def measured(self, name: str, batch: int) -> int:
        """Steps of this choice measured at this batch size's bucket (in the window)."""
        return len(self.samples.get((name, bucket(batch)), ()))

    def measured_here(self, kind: str, name: str, batch: int) -> bool:
        """Whether steps at this batch size's bucket price the choice: its own, or its kind's."""
        b = bucket(batch)
        kin = (n for names in self.kinds.get(kind, {}).values() for n in names)
        return (name, b) in self.samples or any((n, b) in self.samples for n in kin)

    def suspect(self, kind: str, name: str, batch: int, tolerance: float = 0.1) -> bool:
        """Whether a choice's own figure at this batch size's bucket rests on one or two steps and
        stands more than `tolerance` above the median of its kind's figures confirmed there by
        three steps (a batch size's first steps can run slow: see AutoPolicy.plan)."""
        b = bucket(batch)
        own = self.samples.get((name, b))
        if not own or len(own) >= 3:
            return False
        kin = [_value(self.samples[(n, b)]) for names in self.kinds.get(kind, {}).values() for n in names
               if n != name and len(self.samples.get((n, b), ())) >= 3]
        return bool(kin) and _value(own) > (1 + tolerance) * statistics.median(kin)

    def ratio(self, kind: str, name: str, width: int, batch: int, optimistic: bool = False) -> float:
        """optimistic: a borrowed figure resting on fewer than three steps is only an upper bound;
        the next figure in order, down to the first one confirmed by three steps (with none: what
        the choices confirmed at this bucket typically measure, else the bare model), may lower
        it. Challenges price their rivals so: on the H200 one chain step at 1.8x its model (a
        transient) priced every chain at batch 1 for the rest of the run (0.90 of the best fixed
        mode, a = 0.9)."""
        b = bucket(batch)
        if (name, b) in self.samples:
            return _value(self.samples[(name, b)])
        return min(self._estimate(kind, name, width, b, optimistic), self.bounds.get((name, b), float("inf")))

    def _estimate(self, kind: str, name: str, width: int, b: int, optimistic: bool) -> float:
        """A choice not measured at bucket b: borrowed (see ratio)."""
        best = None
        for ratios, scale in self._borrowed(kind, name, width, b):
            value = _value(ratios) * scale
            if not optimistic:
                return value
            best = value if best is None else min(best, value)
            if len(ratios) >= 3:   # confirmed: what comes after it is a cruder guess
                return best
        if best is None:
            return 1.0
        confirmed = [_value(q) for (_, x), q in self.samples.items() if x == b and len(q) >= 3]
        return min(best, statistics.median(confirmed) if confirmed else 1.0)

    def _borrowed(self, kind: str, name: str, width: int, b: int):
        """(ratios, scale) for a choice not measured at bucket b, in the order a figure is taken
        from: its kind's at b (closest width first), then its own or its kind's at the nearest
        bucket, times the trend between the buckets."""
        by_width = sorted(self.kinds.get(kind, {}).items(), key=lambda kv: (abs(kv[0] - width), kv[0]))
        kin = [n for _, names in by_width for n in sorted(names) if n != name]
        for other in kin:
            if (other, b) in self.samples:
                yield self.samples[(other, b)], 1.0
        for candidate in [name, *kin]:
            near = self._nearest_bucket(candidate, b)
            if near is not None:
                # A plain step is the verifier's alone: the trend the speculative choices measured
                # between the buckets (their drafts contending on a shared GPU) is not its. On the
                # H100 (a = 0.6) off, not run at 17-32 while chains ran there, was priced at 13.1 ms
                # where its steps take 10.4, and auto speculated at 0.78x of off.
                trend = 1.0 if kind == self.plain_kind else self._trend(near, b)
                yield self.samples[(candidate, near)], trend

    def _nearest_bucket(self, name: str, b: int) -> int | None:
        measured = nearest_first({x for (n, x) in self.samples if n == name}, b)
        return measured[0] if measured else None

    def _trend(self, src: int, dst: int) -> float:
        """How calibrations changed from bucket `src` to `dst`: the median ratio over the choices
        measured at both (1 when none was)."""
        both = [_value(self.samples[(n, dst)]) / _value(q) for (n, x), q in self.samples.items()
                if x == src and (n, dst) in self.samples]
        return statistics.median(both) if both else 1.0


STALLED = 1.5   # a step this many times its choice's least recent one stalled (see _value)


def _value(ratios: deque) -> float:
    """A choice's calibration from its recent ratios: the median of those not stalled, or while
    fewer than three were measured their least (a first step may have paid for a connection or an
    allocation). A stall (a collection pause, the step after a catch-up) only ever slows a step,
    so a ratio more than STALLED times the least is left out: on the H100 at C = 64, two stalled
    off steps (21-23 ms verifies where the others took 10.5) and one after the first chain step's
    catch-up made 3 of off's last 5 ratios and priced off at 29 ms a step (12 measured); no step
    of off ran there again to correct it while chain k=4 stood, at 0.88x of off."""
    if len(ratios) < 3:
        return min(ratios)
    least = min(ratios)
    return statistics.median([r for r in ratios if r <= STALLED * least])


class CostModel:
    """Predicted seconds of a verify step (batch, width) and of a draft step (batch, drafter shape).
    shared_accelerator: the drafter computes on the verifier's GPU (or CPU), so work sent to both
    at once takes about the sum of their times, not the longer one (each profile was measured
    alone)."""

    def __init__(self, verifier: list[StepCost], drafter: list[StepCost], shared_accelerator: bool = False) -> None:
        self.shared_accelerator = shared_accelerator
        self.verify_widths: dict[int, _Surface] = {}
        by_width: dict[int, list] = defaultdict(list)
        for c in verifier:
            by_width[int(c.shape.split(":")[1])].append((c.batch, c.seconds))
        self.verify_widths = {w: _Surface(p) for w, p in sorted(by_width.items())}
        by_shape: dict[str, list] = defaultdict(list)
        for c in drafter:
            by_shape[c.shape].append((c.batch, c.seconds))
        self.draft_shapes = {s: _Surface(p) for s, p in by_shape.items()}
        # The profiles never change: each (batch, shape) is interpolated once (a plan asks hundreds).
        self._verify_cache: dict[tuple[int, int], float] = {}
        self._draft_cache: dict[tuple[int, str], float] = {}

    def has_draft_shape(self, shape: str) -> bool:
        return shape in self.draft_shapes

    def covers_width(self, width: int) -> bool:
        """Whether the verifier's profile reaches this width (past it, a verify would be priced as
        the widest it measured: a CPU verifier leaves wide trees out)."""
        return width <= max(self.verify_widths, default=0)

    def verify(self, batch: int, width: int) -> float:
        key = (batch, width)
        seconds = self._verify_cache.get(key)
        if seconds is None:
            seconds = self._verify_cache[key] = self._verify(batch, width)
        return seconds

    def _verify(self, batch: int, width: int) -> float:
        widths = list(self.verify_widths)
        if width in self.verify_widths:
            return self.verify_widths[width].at(batch)
        lo = max((w for w in widths if w < width), default=widths[0])
        hi = min((w for w in widths if w > width), default=widths[-1])
        a, b = self.verify_widths[lo].at(batch), self.verify_widths[hi].at(batch)
        return a if hi == lo else a + (b - a) * (width - lo) / (hi - lo)

    def draft(self, batch: int, shape: str) -> float:
        key = (batch, shape)
        seconds = self._draft_cache.get(key)
        if seconds is None:
            seconds = self._draft_cache[key] = self.draft_shapes[shape].at(batch) if batch else 0.0
        return seconds


class StepOverheads:
    """What the steps of a kind (off, speculating) take over their calibrated clean time, per prompt
    they admit, at a batch bucket; a choice's overhead is that times the prompts it will admit a
    step (RequestLengths).

    StepCalibration learns from clean steps only (a prefill would blur a choice's cost). Under a
    stream of arrivals many steps are not clean, and how many depends on the choice: a request
    that commits more tokens a step ends sooner, and its client's next prompt comes sooner. On the
    H200 closed loop at a = 0.8, C = 32, chain k=4's clean steps took ~28 ms and its steps ~37 ms on
    average. So this measures the excess per admitted prompt (the verifier's prefill, a drafter's
    catch-up) over groups of arrivals: a step that admits prompts opens a group, which also takes
    the excess of the steps after it while prompts still prefill (a long prompt prefills in chunks)
    and of the one after those (a drafter takes in a prompt's hidden states when it first drafts),
    up to the next admission. A step that still prefills prompts of earlier groups (the newest
    ones: prompts finish their prefill in the order they came) is shared with those groups by
    prompts. On the H100 (C = 64) a wave's 43 prompts joined under off and 20 more under chain k=4 a
    step later, and the next five steps prefilled all 63; when the newest group took every step,
    the chain's 20 took them all: 5.4 ms a prompt where the chain row's prompts cost 3.3, and auto
    ran off at 0.88x of chain k=4. A group counts at the batch its prompts join (they included), and a
    wave is a group like any other (one into an empty batch counts for both kinds: nothing else
    ran): clients that mode off keeps in lockstep admit nothing but waves, and leaving waves out
    priced off at its clean steps (H100, C = 32: 3,200 tok/s where off ran 2,440, and auto ran off
    there at 0.92x of chain k=4). Before groups, the excess of steps after a wave admitted beside
    few requests was charged to the few prompts of an earlier group at the wave's batch (24 ms a
    prompt where they cost 3-4 ms). Speculation not yet measured at a bucket borrows its own figure
    at the nearest bucket that has one, never less than what off is charged there (a speculating
    step admits a prompt as a plain one does and also ships its rows to the drafter, which takes them
    in): it is then tried, and its own figure replaces it. (It once borrowed off's figure at that
    bucket only, else nothing: on the H100 at a = 0.8, C = 64, each wave's first prompts joined a
    batch of 8 under tree 2/4/8, its prompts charged nothing against off's 13 ms a step, in steps of
    42-49 ms where off's took 27-30. Then off's alone: on the H100 at C = 64, where auto seldom
    speculated, its prompts were charged 2.9 ms where they cost 3.8 and off's 2.2, clean chain k=4
    steps looked 33% ahead of off's, and auto kept switching to it, at 0.87x of off.) Off not yet
    measured at a bucket takes its own figure at the
    nearest bucket (its prompts cost the verifier's prefill, about the same at any batch size), never
    speculation's: off is not challenged, so a figure too high would keep it from ever running there
    to measure its own (where speculation's prompts cost 3x off's, a closed-loop simulation ran auto
    at 0.82x of off with it). With no figure of its own
    anywhere, off is charged nothing. Off charged nothing at C = 32 on the H100 (a = 0.8) where it
    had cost 4.7 ms a prompt at 16, and its first wave there ran off for ~55 steps beside chain k=4
    priced at 7-8 ms a step for its prompts."""

    def __init__(self, window: int = 16, min_prompts: int = 8, max_age: int = 512) -> None:
        """window: groups kept per kind and bucket; min_prompts: prompts those groups must hold to
        price the kind; max_age: steps (all kinds) after which a group of speculation's no longer
        counts: once auto has turned to off, speculation's figure from a busier spell must not keep
        it off for good; it is then borrowed from off's again, tried, and measured afresh. Off's own
        groups keep counting, however old, until newer ones replace them: off's prompts cost the
        verifier's prefill, which a busier spell does not change, and an expired figure priced off's
        prompts at nothing. On the H100 (C = 32, a = 0.8) off's figure there (4.4 ms a prompt)
        expired while the sweep's fixed rows ran (~830 steps; every step counts), and auto's next
        wave ran off, its prompts charged nothing, for ~25 steps until off was measured again."""
        self.window, self.min_prompts, self.max_age = window, min_prompts, max_age
        self.steps = 0
        self.groups: dict[tuple[bool, int], deque] = {}   # (speculating, bucket) -> [last step, excess s, prompts]
        self.open: deque = deque(maxlen=window)            # groups whose prompts may still prefill, newest last
        self.sharing: list[list] = []                      # the groups that took the last step's excess
        self.cached: dict[tuple[bool, int], float] = {}    # figures since the last step (a plan asks per choice)

    def tick(self) -> None:
        """One step of any kind has run."""
        self.steps += 1
        self.cached.clear()

    def observe(self, speculating: bool | None, batch: int, excess: float, admitted: int, prefilling: bool,
                carried: int = 0) -> None:
        """A measured step that admitted `admitted` prompts into a batch of `batch` requests (they
        included; prefilling: it also prefilled prompt chunks; carried: of prompts that earlier steps
        admitted), `excess` seconds over its clean price. speculating None: a step with nothing
        running, whose group counts for both kinds."""
        earlier = []   # the newest earlier groups, as many as hold the carried prompts
        for group in reversed(self.open):
            if carried <= 0:
                break
            earlier.append(group)
            carried -= group[2]
        new = [[self.steps, 0.0, admitted]] if admitted else []
        for group in new:
            self.open.append(group)
            for kind in (False, True) if speculating is None else (speculating,):
                self.groups.setdefault((kind, bucket(batch)), deque(maxlen=self.window)).append(group)
        sharing = new + earlier or self.sharing   # no prompt of its own: the groups of the step before
        prompts = sum(group[2] for group in sharing)
        for group in sharing:
            group[0] = self.steps
            group[1] += excess * group[2] / prompts
        self.sharing = sharing
        if not (admitted or prefilling):   # the step after their prompts' prefill was the groups' last
            self._close()
        self.cached.clear()

    def skip(self, admitted: int) -> None:
        """A step that was not measured: if it admitted prompts, the steps after it are theirs, not the
        open groups'."""
        if admitted:
            self._close()

    def _close(self) -> None:
        self.open.clear()
        self.sharing = []

    def per_admission(self, speculating: bool, batch: int) -> float:
        """Seconds a step of this kind takes over its clean time per prompt it admits."""
        key = (speculating, bucket(batch))
        if key not in self.cached:
            self.cached[key] = self._per_admission(*key)
        return self.cached[key]

    def _per_admission(self, speculating: bool, b: int) -> float:
        if speculating:   # its own figure here, else its own nearest, never below what off is charged here
            own = self._figure((True, b))
            if own is not None:
                return own
            return max(self._nearest(True, b), self._per_admission(False, b))
        return self._nearest(False, b)

    def _nearest(self, speculating: bool, b: int) -> float:
        """The kind's own figure at the bucket nearest b that has one (0 where none has)."""
        for x in nearest_first({x for kind, x in self.groups if kind == speculating}, b):
            figure = self._figure((speculating, x))
            if figure is not None:
                return figure
        return 0.0

    def _figure(self, key: tuple[bool, int]) -> float | None:
        """Seconds per prompt from a kind's groups at a bucket (None: too few prompts)."""
        groups = [(x, n) for step, x, n in self.groups.get(key, ()) if not key[0] or self.steps - step <= self.max_age]
        prompts = sum(n for _, n in groups)
        return max(0.0, sum(x for x, _ in groups)) / prompts if prompts >= self.min_prompts else None


class RequestLengths:
    """Tokens generated per request over the last `window` requests that ended: a choice committing T
    tokens a step ends T / (mean length) requests a step, and so admits as many prompts (a closed
    loop or a queue: every request that ends makes room for the next). Counted from endings, not
    from the admissions a window of steps saw: clients that mode off keeps in lockstep admit a wave
    once a request length, which such a window holds whole or misses.

    The mean that prices a plan is the running requests' own (`running`): each is expected to reach
    the mean length of the ended requests that outlived what it has generated (capped at its own
    limit), so a burst of short requests that ended does not stand for the longer ones still
    running. The sweep's 64 two-token warm-ups before each wave at C = 64 filled the window: the
    unconditioned mean (2 tokens) had every step admit 32 prompts, charged off 170 ms a step and
    chain k=2 401 (H100, 8B), and auto ran off where chain k=4 won (0.95x of it)."""

    def __init__(self, window: int = 64) -> None:
        self.lengths: deque = deque(maxlen=window)
        self.total = 0          # the window's sum
        self.expected = None    # the running requests' expected length (`running`); None: the window's mean

    def observe(self, generated: int) -> None:
        if len(self.lengths) == self.lengths.maxlen:
            self.total -= self.lengths[0]
        self.lengths.append(generated)
        self.total += generated

    def running(self, generated: np.ndarray, limits: np.ndarray) -> None:
        """The requests the next plans are for: [n] tokens each has generated and may generate at
        most. Each is expected to end at the mean of min(length, its limit) over the ended requests
        longer than what it has generated (at its limit when none was); the batch's expected
        length is the harmonic mean of those (each request ends at its own rate)."""
        if not self.lengths or not len(generated):
            self.expected = None
            return
        ended = np.fromiter(self.lengths, dtype=np.float64)          # [S]
        outlived = ended[None, :] > generated[:, None]               # [n, S]
        capped = np.minimum(ended[None, :], limits[:, None])         # [n, S]
        count = outlived.sum(axis=1)
        each = np.where(count > 0, (capped * outlived).sum(axis=1) / np.maximum(count, 1), limits)   # [n]
        self.expected = float(1.0 / np.mean(1.0 / np.maximum(each, 1.0)))

    def length(self) -> float | None:
        """The running requests' expected length (else the window's mean; None until a request ended)."""
        if not self.total:
            return None
        return self.expected if self.expected is not None else self.total / len(self.lengths)

    def admissions(self, tokens: float) -> float:
        """Expected prompts admitted a step for a choice committing `tokens` a step (0 until a request ended)."""
        length = self.length()
        return tokens / length if length else 0.0
