"""Running acceptance estimates for `--mode auto`: per draft position, per drafter and per request.

A draft shape family ("chain", or one tree preset) has a conditional acceptance rate per position:
p[j] = P(the verifier accepts draft position j+1 | it accepted positions 1..j). One verify step
that drafted `depth` positions and accepted `a` of them tried positions 1..min(a+1, depth) and
accepted 1..a. Counts decay geometrically, so the estimates follow drift in what is being written.

Each drafter replica keeps one estimate per family (all its requests); each request keeps its own,
shrunk towards its drafter's with `prior_weight` pseudo-observations, so a new request starts at
the drafter's figure and an unusual one moves away from it within a few steps. A family that no
request has tried yet starts optimistic (see `Rates.unexplored`) so the policy tries it once and
measures it rather than trusting a guess forever.
"""

from __future__ import annotations

import numpy as np

MAX_POSITIONS = 16          # longest chain or deepest tree a family covers
UNTRIED_RATE = 0.8          # a drafter's acceptance before any verdict


class Rates:
    """Decaying counts of tried / accepted per draft position for one family."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.tried = np.zeros(MAX_POSITIONS)
        self.accepted = np.zeros(MAX_POSITIONS)
        self.count = 0

    def observe_many(self, depths: np.ndarray, accepted: np.ndarray) -> None:
        """n verdicts in order, each decaying the counts before it (the i-th weighs decay^(n-1-i))."""
        n = len(depths)
        weights = self.decay ** np.arange(n - 1, -1, -1, dtype=np.float64)          # [n]
        tried, right = position_masks(depths, accepted)                              # [n, P] each
        self.tried = self.tried * self.decay ** n + weights @ tried
        self.accepted = self.accepted * self.decay ** n + weights @ right
        self.count += n

    def estimate(self, prior: np.ndarray, weight: float) -> np.ndarray:
        """Per-position rates [MAX_POSITIONS], each shrunk towards `prior` by `weight` pseudo-counts."""
        return (self.accepted + weight * prior) / (self.tried + weight)

    def pooled(self, prior: np.ndarray, weight: float, ucb: float, per_position: bool = False) -> np.ndarray:
        """The drafter's rates: each position shrunk towards the family's rate over all positions
        (itself shrunk towards `prior`), so a deep position seen a few times is not judged on
        them alone (a draft right 80% of the time at position 1 is not assumed 40% at position 2
        after one miss there); plus `ucb` standard errors of the family's figure, so a family
        measured on a few unlucky verdicts still looks good enough to be tried again, until its
        figures are sure. One error for the family, not one per position: per-position errors
        compound along a chain (the deep positions, tried least, the most), and on the H200
        (a = 0.8, C = 1) auto then expected 5.6-5.8 tokens of a chain of 8 that commits 4.3, and
        ran deep chains and trees at 0.92 of the chain of 4 it should have kept. per_position: one
        error per position instead, the optimistic figure a challenger is priced with."""
        tried = self.tried.sum()
        overall = (self.accepted.sum() + float(prior.mean())) / (tried + 1.0)
        n = self.tried + weight
        rates = (self.accepted + weight * overall) / n
        if per_position:
            error = np.sqrt(rates * (1.0 - rates) / n)
        else:
            error = np.sqrt(overall * (1.0 - overall) / (tried + weight))
        return np.minimum(rates + ucb * error, 0.99)

    @property
    def observations(self) -> int:
        """Verdicts seen (not decayed)."""
        return self.count

    @staticmethod
    def unexplored(reference: np.ndarray | None, optimism: float) -> np.ndarray:
        """A prior for a family nobody has measured: a reference family's rates (a chain's for a
        tree, whose best child is at least as good) raised towards 1, or an optimistic guess. It
        counts as one observation: a few verdicts outweigh it."""
        if reference is None:   # a new drafter: optimistic, so speculation is tried (and measured) at once
            return np.full(MAX_POSITIONS, UNTRIED_RATE)
        return 1.0 - (1.0 - reference) ** optimism


def expected_tokens(rates: np.ndarray, depth: int) -> np.ndarray:
    """Tokens a step commits, bonus included: 1 + sum_j prod_{i<=j} p_i over `depth` positions.
    rates [..., MAX_POSITIONS] -> [...]."""
    return 1.0 + np.cumprod(rates[..., :depth], axis=-1).sum(-1)


def position_masks(depths: np.ndarray, accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Verdicts [n] -> positions tried [n, P] (1..min(a+1, depth)) and accepted [n, P] (1..a), as 0/1."""
    positions = np.arange(MAX_POSITIONS)
    tried = positions < np.minimum(accepted + 1, depths)[:, None]
    return tried.astype(np.float64), (positions < accepted[:, None]).astype(np.float64)


class RequestTable:
    """Every request's decaying counts for one family, a row each, so one step's verdicts update
    all their rows in a few array operations (not a handful per request)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.rows: dict[str, int] = {}
        self.free: list[int] = []
        self.tried = np.zeros((8, MAX_POSITIONS))
        self.accepted = np.zeros((8, MAX_POSITIONS))

    def _row(self, seq_id: str) -> int:
        row = self.rows.get(seq_id)
        if row is None:
            if not self.free:
                n = len(self.tried)
                self.tried = np.concatenate([self.tried, np.zeros_like(self.tried)])
                self.accepted = np.concatenate([self.accepted, np.zeros_like(self.accepted)])
                self.free = list(range(2 * n - 1, n - 1, -1))
            row = self.rows[seq_id] = self.free.pop()
        return row

    def observe_many(self, seq_ids: list[str], depths: np.ndarray, accepted: np.ndarray) -> None:
        """One verdict per request (seq_ids distinct)."""
        rows = np.fromiter((self._row(s) for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        tried, right = position_masks(depths, accepted)
        self.tried[rows] = self.tried[rows] * self.decay + tried
        self.accepted[rows] = self.accepted[rows] * self.decay + right

    def counts(self, seq_ids: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """-> tried, accepted [len(seq_ids), P] (zeros for a request with no verdict yet)."""
        rows = np.fromiter((self.rows.get(s, -1) for s in seq_ids), dtype=np.int64, count=len(seq_ids))
        known = (rows >= 0)[:, None]
        return (np.where(known, self.tried[rows.clip(min=0)], 0.0),
                np.where(known, self.accepted[rows.clip(min=0)], 0.0))

    def age(self, seq_ids: list[str], factor: float) -> None:
        """Scale these requests' counts by `factor` (those with a row)."""
        rows = [r for r in map(self.rows.get, seq_ids) if r is not None]
        if rows:
            self.tried[rows] *= factor
            self.accepted[rows] *= factor

    def forget(self, seq_id: str) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self.tried[row] = self.accepted[row] = 0.0
            self.free.append(row)


class PreDraftHits:
    """The measured share of overlap pre-drafts that a verdict could use, per draft length k (decayed
    counts). Whole-draft acceptance alone misjudges it: a pre-draft must also have guessed the bonus
    token (fewer hits), and a hedging drafter's pre-drafts also cover rejections (more hits)."""

    def __init__(self, decay: float = 0.99, min_observations: float = 20.0) -> None:
        self.decay, self.min_observations = decay, min_observations
        self.counts: dict[int, list[float]] = {}    # k -> [hits, pre-drafts]

    def observe(self, k: int, hit: bool) -> None:
        c = self.counts.setdefault(k, [0.0, 0.0])
        c[0] = c[0] * self.decay + hit
        c[1] = c[1] * self.decay + 1.0

    def rate(self, k: int) -> float | None:
        """The hit rate for pre-drafts after a draft of k, or None until enough were seen."""
        c = self.counts.get(k)
        return c[0] / c[1] if c is not None and c[1] >= self.min_observations else None


class TokenCalibration:
    """Accepted drafts over the drafts the policy expected, over the requests its plans made
    speculate (challenges and probes left out). The estimates above are unbiased for a choice run
    regardless of them, but the policy speculates when and where they are high, so what it runs
    it has overestimated on average. Replayed on recorded SmolLM2 verdicts (tests/test_auto_replay.py),
    a chosen tree committed 4-15% fewer tokens than expected and a chosen chain k=4 25-30% fewer;
    where only easy requests should speculate, auto ran at 0.96-0.97 of off. One figure for all
    speculative choices: it corrects speculation against off, and no choice's own figure can sink
    on an unlucky start and keep it from running again (with one figure per choice, some replays
    kept a worse tree throughout: 0.93-0.96 of the best). Starts at 1 (`prior` pseudo-tokens),
    decays per verdict, stays within [lo, hi]."""

    def __init__(self, decay: float = 0.995, prior: float = 30.0, lo: float = 0.7, hi: float = 1.25) -> None:
        self.decay, self.prior, self.lo, self.hi = decay, prior, lo, hi
        self.expected = self.accepted = 0.0

    def observe(self, expected: float, accepted: float, verdicts: int) -> None:
        """One step's `verdicts` verdicts: their expected and accepted drafts, summed."""
        keep = self.decay ** verdicts
        self.expected = self.expected * keep + expected
        self.accepted = self.accepted * keep + accepted

    @property
    def ratio(self) -> float:
        return min(self.hi, max(self.lo, (self.accepted + self.prior) / (self.expected + self.prior)))


class AcceptanceBook:
    """One drafter replica's estimates and its requests' estimates, per family, and its pre-drafts' hits."""

    def __init__(self, drafter_decay: float = 0.998, request_decay: float = 0.99, prior_weight: float = 10.0,
                 optimism: float = 2.0, pool_weight: float = 4.0, ucb: float = 1.0, idle_decay: float = 0.9) -> None:
        self.idle_decay = idle_decay
        self.pool_weight, self.ucb = pool_weight, ucb
        self.drafter_decay, self.request_decay = drafter_decay, request_decay
        self.prior_weight, self.optimism = prior_weight, optimism
        self.drafter: dict[str, Rates] = {}
        self.requests: dict[str, RequestTable] = {}   # by family
        self.predraft_hits = PreDraftHits()
        self.cached: dict[tuple[str, bool], np.ndarray] = {}   # drafter_rates until the next verdicts

    def observe(self, seq_id: str, family: str, depth: int, accepted: int) -> None:
        self.observe_many([seq_id], family, np.array([depth]), np.array([accepted]))

    def observe_many(self, seq_ids: list[str], family: str, depths: np.ndarray, accepted: np.ndarray) -> None:
        """A step's verdicts for one family, one per request (seq_ids distinct), in order."""
        self.cached.clear()
        self.drafter.setdefault(family, Rates(self.drafter_decay)).observe_many(depths, accepted)
        self.requests.setdefault(family, RequestTable(self.request_decay)).observe_many(seq_ids, depths, accepted)

    def forget(self, seq_id: str) -> None:
        for table in self.requests.values():
            table.forget(seq_id)

    def age_idle(self, seq_ids: list[str], steps: int) -> None:
        """These requests ran `steps` steps without drafting: their own figures count less (by
        `idle_decay` a step), so their estimates drift back towards the drafter's."""
        for table in self.requests.values():
            table.age(seq_ids, self.idle_decay ** steps)

    def drafter_observations(self, family: str) -> int:
        own = self.drafter.get(family)
        return own.observations if own is not None else 0

    def drafter_rates(self, family: str, optimistic: bool = False) -> np.ndarray:
        """optimistic: with per-position errors (Rates.pooled), for pricing challengers. (Read-only:
        kept until the next verdicts, as a plan asks once per family and choice.)"""
        rates = self.cached.get((family, optimistic))
        if rates is None:
            rates = self.cached[(family, optimistic)] = self._drafter_rates(family, optimistic)
        return rates

    def _drafter_rates(self, family: str, optimistic: bool) -> np.ndarray:
        chain = self.drafter.get("chain")
        untried = np.full(MAX_POSITIONS, UNTRIED_RATE)
        reference = chain.pooled(untried, self.pool_weight, 0.0) if chain and chain.observations else None
        prior = Rates.unexplored(reference if family != "chain" else None, self.optimism)
        own = self.drafter.get(family)
        return own.pooled(prior, self.pool_weight, self.ucb, optimistic) if own is not None else prior

    def request_rates(self, seq_ids: list[str], family: str, optimistic: bool = False) -> np.ndarray:
        """[len(seq_ids), MAX_POSITIONS]: each request's rates for `family` (one vectorised shrink)."""
        prior = self.drafter_rates(family, optimistic)
        table = self.requests.get(family)
        if table is None:
            return np.broadcast_to(prior, (len(seq_ids), MAX_POSITIONS)).copy()
        tried, accepted = table.counts(seq_ids)
        return (accepted + self.prior_weight * prior) / (tried + self.prior_weight)
