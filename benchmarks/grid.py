"""What a run measures: the speculation configurations and the (acceptance, concurrency,
configuration) cells of each model pair.

The default run fits in about eight minutes on one H200: every configuration at every
concurrency at the headline acceptance a = 0.8, and an acceptance sweep (a = 0, 0.6, 0.9) of
chain k=4 (overlap on and off) and tree topk=4 at C = 1 and 16; both through the engines
in-process and through the gateway. `--full` crosses everything (about half an hour), `--quick`
is a smoke run, and explicit --acceptance / --concurrency / --configs lists are crossed as given.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product

from specdec.cost_profile import AUTO_CHAIN_KS


@dataclass(frozen=True)
class SpecConfig:
    name: str
    mode: str               # "off" | "chain" | "tree" | "auto" (the gateway's policy: gateway path only)
    k: int = 0
    overlap: bool = True
    topk: int = 0
    depth: int = 0
    budget: int = 0

    @property
    def speculative(self) -> bool:
        return self.mode != "off"

    @property
    def path_depth(self) -> int:
        """Draft tokens on the longest path of one verify step (a chain's k, a tree's depth)."""
        return {"chain": self.k, "tree": self.depth}.get(self.mode, 0)

    @property
    def lookahead(self) -> int:
        """Positions past the committed tokens a draft can reach: a pre-draft assumes the chain in
        flight and drafts k + 1 more."""
        if self.mode == "auto":   # its longest choice: chain k=8 with overlap
            return 2 * max(AUTO_CHAIN_KS) + 1
        return 2 * self.k + 1 if self.mode == "chain" and self.overlap else self.path_depth

    def request_fields(self) -> dict:
        """SpeculationConfig fields of a gateway request."""
        if self.mode == "chain":
            return {"k": self.k, "overlap": self.overlap}
        if self.mode == "tree":
            return {"topk": self.topk, "depth": self.depth, "budget": self.budget}
        return {}


CONFIGS = {c.name: c for c in [
    SpecConfig("off", "off"),
    *(SpecConfig(f"chain k={k}{'' if ov else ' no-overlap'}", "chain", k=k, overlap=ov)
      for k in (2, 4, 6) for ov in (True, False)),
    SpecConfig("tree topk=2", "tree", topk=2, depth=4, budget=8),
    SpecConfig("tree topk=4", "tree", topk=4, depth=5, budget=16),
    SpecConfig("tree topk=8 depth=7 budget=64", "tree", topk=8, depth=7, budget=64),   # the widest graphed tree
    SpecConfig("auto", "auto"),
]}
CONCURRENCY = (1, 4, 16, 32, 64)
ACCEPTANCE = (0.0, 0.6, 0.8, 0.9)
HEADLINE = 0.8                  # the acceptance of the modes x concurrency figure
SWEEP_CONFIGS = ("chain k=4", "chain k=4 no-overlap", "tree topk=4", "auto")
SWEEP_CONCURRENCY = (1, 16)
SMOLLM2_CONFIGS = ("off", "chain k=2", "chain k=4", "chain k=4 no-overlap", "tree topk=2", "tree topk=4", "auto")
QUICK_CONFIGS = ("off", "chain k=4", "chain k=4 no-overlap", "tree topk=4", "auto")


@dataclass(frozen=True)
class Cell:
    acceptance: float | None    # None: mode off (no drafts) or a real drafter
    concurrency: int
    config: SpecConfig


@dataclass(frozen=True)
class Plan:
    cells: tuple[Cell, ...]     # the random pair: in-process and through the gateway
    smollm2: tuple[Cell, ...]   # the embedded pair (real acceptance), through the gateway

    @property
    def acceptances(self) -> list[float]:
        return sorted({c.acceptance for c in self.cells if c.acceptance is not None})

    @property
    def max_concurrency(self) -> int:
        return max((c.concurrency for c in self.cells + self.smollm2), default=1)

    @property
    def lookahead(self) -> int:
        return max((c.config.lookahead for c in self.cells), default=0)


def _cells(acceptances, concurrencies, names) -> list[Cell]:
    """Mode off once per concurrency (it does not depend on a), then the speculative cells."""
    out = [Cell(None, c, CONFIGS["off"]) for c in concurrencies if "off" in names]
    out += [Cell(a, c, CONFIGS[n]) for a, c, n in product(acceptances, concurrencies, names) if n != "off"]
    return out


def _ordered(cells: list[Cell]) -> tuple[Cell, ...]:
    """Unique cells; mode off first (speedups need it), then by acceptance and concurrency."""
    unique = list(dict.fromkeys(cells))
    order = {n: i for i, n in enumerate(CONFIGS)}
    return tuple(sorted(unique, key=lambda c: (c.acceptance is not None, c.acceptance or 0.0, c.concurrency,
                                               order[c.config.name])))


def build_plan(acceptance: list[float] | None, concurrency: list[int] | None, configs: list[str] | None,
               quick: bool, full: bool) -> Plan:
    if acceptance or concurrency or configs or full:
        cells = _cells(acceptance or ACCEPTANCE, concurrency or CONCURRENCY, configs or list(CONFIGS))
        smollm2 = _cells([None], [c for c in (concurrency or SWEEP_CONCURRENCY)], configs or SMOLLM2_CONFIGS)
    elif quick:
        cells = _cells([HEADLINE], SWEEP_CONCURRENCY, QUICK_CONFIGS) + _cells([0.0, 0.9], [1], ["chain k=4"])
        smollm2 = _cells([None], SWEEP_CONCURRENCY, ("off", "chain k=4", "tree topk=4"))
    else:
        cells = (_cells([HEADLINE], CONCURRENCY, list(CONFIGS))
                 + _cells([a for a in ACCEPTANCE if a != HEADLINE], SWEEP_CONCURRENCY, SWEEP_CONFIGS))
        smollm2 = _cells([None], SWEEP_CONCURRENCY, SMOLLM2_CONFIGS)
    return Plan(_ordered(cells), _ordered(smollm2))
