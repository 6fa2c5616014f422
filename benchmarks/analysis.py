"""Figures derived from the rows of a run: the draft/target cost ratio c and the analytic ideal,
step time against the memory-traffic limit, and the gateway's share of a step."""

from __future__ import annotations

from benchmarks.grid import CONFIGS, HEADLINE
from benchmarks.metrics import RunResult, ideal_speedup

IDEAL_K = 4
IN, GW = "in-process", "gateway"


def find(rows: list[RunResult], path: str, config: str, c: int, a: float | None, pair: str | None = None):
    return next((r for r in rows if r.path == path and r.config == config and r.concurrency == c
                 and r.acceptance == a and (pair is None or r.pair == pair)), None)


def headline(rows: list[RunResult]) -> float | None:
    """The acceptance of the modes x concurrency figure: 0.8 if measured, else the most measured."""
    seen = [r.acceptance for r in rows if r.acceptance is not None and r.path in (IN, GW)]
    if not seen:
        return None
    return HEADLINE if HEADLINE in seen else max(set(seen), key=seen.count)


def cost_ratio(rows: list[RunResult], a: float | None = None) -> dict | None:
    """c = (drafter call before a verify step / k) / (mode off step), in-process at C = 1, from the
    k = 4 chain without overlap (its drafter calls are not overlapped with verification); at
    acceptance a when measured (the catch-up a drafter call feeds grows with acceptance)."""
    off = find(rows, IN, "off", 1, None)
    chains = [r for r in rows if r.path == IN and r.config == f"chain k={IDEAL_K} no-overlap"
              and r.concurrency == 1 and r.draft_ms is not None]
    chain = next((r for r in chains if r.acceptance == a), chains[0] if chains else None)
    if off is None or chain is None or not off.step_ms:
        return None
    draft_token_ms = chain.draft_ms / IDEAL_K
    return {"draft_token_ms": draft_token_ms, "target_step_ms": off.step_ms, "c": draft_token_ms / off.step_ms,
            "verify_k_step_ms": chain.verify_ms}


def ideal_rows(rows: list[RunResult], a: float | None) -> list[dict]:
    """Measured speedup over the ideal (1 - a^(k+1)) / ((1 - a)(1 + k c)) for chain k=4 at C = 1."""
    cr = cost_ratio(rows, a)
    if cr is None or a is None:
        return []
    ideal = ideal_speedup(a, IDEAL_K, cr["c"])
    out = []
    for path in (IN, GW):
        for cfg in (f"chain k={IDEAL_K} no-overlap", f"chain k={IDEAL_K}"):
            r = find(rows, path, cfg, 1, a)
            if r is not None and r.speedup is not None:
                out.append({"path": path, "config": cfg, "a": a, "c": cr["c"], "ideal": ideal,
                            "speedup": r.speedup, "ratio": r.speedup / ideal, "accept_len": r.accept_len})
    return out


def roofline_rows(rows: list[RunResult], traffic: dict | None, pair: str) -> list[dict]:
    """Mode off at batch 1: the memory-traffic limit over the measured step, per path."""
    if not traffic:
        return []
    out = []
    for path in (IN, GW):
        r = find(rows, path, "off", 1, None, pair)
        if r is not None and r.step_ms:
            out.append({"path": path, "step_ms": r.step_ms, "limit_ms": traffic["limit_ms"],
                        "fraction": traffic["limit_ms"] / r.step_ms})
    return out


def gateway_share(rows: list[RunResult], r: RunResult) -> float | None:
    """The gateway's share of a step: 1 - in-process step time / gateway step time, same cell."""
    if r.path != GW or not r.step_ms:
        return None
    ip = find(rows, IN, r.config, r.concurrency, r.acceptance, r.pair)
    return None if ip is None or not ip.step_ms else 1 - ip.step_ms / r.step_ms


def config_order(name: str) -> int:
    names = list(CONFIGS)
    return names.index(name) if name in names else len(names)
