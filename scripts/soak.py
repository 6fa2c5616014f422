"""Soak: many concurrent closed-loop streams against a real cluster (gateway, drafter and verifier
processes serving tiny random-weight models on the CPU) for a fixed time. It checks that no
request fails and that the memory of every service process stays flat under sustained load, and
reports throughput and latency percentiles.

    python scripts/soak.py --streams 256 --minutes 10 --max-new-tokens 64 --json soak.json

Each stream sends requests back to back (chain k=3 with and without overlap, tree 2/3/6, off and
auto, in turn, each with its own prompt) until the time is up, then finishes the one in flight;
every request has a deadline, and the run is cut off if one outlives it. The RSS of every service
process (and of its children, e.g. tensor-parallel ranks) is read from /proc every
--sample-seconds; the first sample after --warmup-minutes is the baseline. Prints a progress line
every --progress-seconds and a report at the end; --json OUT writes the figures. Exits 1 if any
request failed or any process's RSS grew more than --max-rss-growth percent after the warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import grpc  # noqa: E402
from cluster import Cluster, request  # noqa: E402
from model_factory import VOCAB, make_checkpoint, make_layer_subset_draft  # noqa: E402

from specdec.rpc import gateway_pb2_grpc  # noqa: E402

MODES = [("chain k=3", "chain", {"k": 3}), ("chain k=3 no-overlap", "chain", {"k": 3, "overlap": False}),
         ("tree 2/3/6", "tree", {"topk": 2, "depth": 3, "budget": 6}), ("off", "off", {}), ("auto", "auto", {})]
SHAPE = "llama-gqa"   # tests/model_factory.py: hidden 64, 3 layers; the draft keeps layer 0


@dataclass
class Done:
    """One completed request."""
    end: float      # seconds since the load started
    ttft: float
    tpot: float     # (total - ttft) / (tokens - 1)
    total: float
    tokens: int
    mode: str


@dataclass
class Tally:
    done: list[Done] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)        # status code name -> count
    error_examples: dict[str, str] = field(default_factory=dict)
    in_flight: int = 0


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=256, help="concurrent closed-loop clients")
    p.add_argument("--minutes", type=float, default=10.0, help="how long streams start new requests")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--warmup-minutes", type=float, default=1.0, help="RSS baseline = first sample after this")
    p.add_argument("--sample-seconds", type=float, default=10.0, help="RSS sampling period")
    p.add_argument("--progress-seconds", type=float, default=30.0)
    p.add_argument("--request-timeout", type=float, default=600.0, help="deadline of each request (generous: "
                   "on two shared cores a request waits behind every other stream's steps)")
    p.add_argument("--max-rss-growth", type=float, default=10.0, help="percent, after the warm-up")
    p.add_argument("--verifiers", type=int, default=1)
    p.add_argument("--drafters", type=int, default=1)
    p.add_argument("--max-sequences", type=int, default=None,
                   help="KV slots per engine (default: --streams, so no request queues at the gateway)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--cost-profile", action=argparse.BooleanOptionalAction, default=True,
                   help="engines time their steps at start-up (what --mode auto prices with)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-dir", type=Path, default=None, help="service logs (default: a temporary directory)")
    p.add_argument("--json", type=Path, default=None, metavar="OUT")
    return p.parse_args()


# ---- memory ------------------------------------------------------------------------------------
def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (FileNotFoundError, ProcessLookupError):
        pass
    return None


def descendants(pid: int) -> list[int]:
    """Children, grandchildren, ... (tensor-parallel ranks, spawn helpers), in pid order."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            found += kids
            todo += kids
    return sorted(set(found))


def sample_rss(cluster: Cluster) -> dict[str, float]:
    """process label -> RSS in MB: each service, and each of its descendants as SERVICE/child-K."""
    out = {}
    for name, proc in cluster.procs.items():
        for label, pid in [(name, proc.pid)] + [(f"{name}/child-{k}", c) for k, c in enumerate(descendants(proc.pid))]:
            mb = rss_mb(pid)
            if mb is not None:
                out[label] = mb
    return out


def slope_per_minute(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    if len(points) < 2:
        return 0.0
    mean_t = statistics.fmean(t for t, _ in points)
    mean_v = statistics.fmean(v for _, v in points)
    var = sum((t - mean_t) ** 2 for t, _ in points)
    return 60 * sum((t - mean_t) * (v - mean_v) for t, v in points) / var if var else 0.0


# ---- load --------------------------------------------------------------------------------------
async def stream(i: int, stub, args, t0: float, stop_at: float, tally: Tally) -> None:
    """Stream i: requests back to back until `stop_at` (loop time), each with its own prompt."""
    rng = random.Random(args.seed * 100_003 + i)
    j = 0
    while time.monotonic() < stop_at:
        label, mode, spec = MODES[(i + j) % len(MODES)]
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(4, 16))]
        req = request(prompt, args.max_new_tokens, mode, **spec)
        req.request_id = f"soak-{i}-{j}"
        j += 1
        start = time.monotonic()
        first, tokens = None, 0
        tally.in_flight += 1
        try:
            async for msg in stub.Generate(req, timeout=args.request_timeout):
                if msg.token_ids:
                    first = first or time.monotonic()
                    tokens += len(msg.token_ids)
            end = time.monotonic()
            first = first or end
            tally.done.append(Done(end - t0, first - start, (end - first) / max(1, tokens - 1), end - start,
                                   tokens, label))
        except grpc.aio.AioRpcError as exc:
            code = exc.code().name
            tally.errors[code] += 1
            tally.error_examples.setdefault(code, f"{label}: {exc.details()}")
            await asyncio.sleep(1.0)   # a failing cluster must not turn the loop into a busy spin
        finally:
            tally.in_flight -= 1


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def fmt_rss(sample: dict[str, float]) -> str:
    return " ".join(f"{name} {mb:.0f}" for name, mb in sample.items())


async def run_load(cluster: Cluster, args) -> tuple[Tally, list[tuple[float, dict[str, float]]], float, bool]:
    """-> (tally, RSS samples (seconds since start, label -> MB), load seconds, cut off)."""
    tally = Tally()
    samples: list[tuple[float, dict[str, float]]] = []
    t0 = time.monotonic()
    stop_at = t0 + args.minutes * 60
    async with grpc.aio.insecure_channel(cluster.addr["gateway"]) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        tasks = [asyncio.create_task(stream(i, stub, args, t0, stop_at, tally)) for i in range(args.streams)]
        next_sample, next_progress = t0, t0 + args.progress_seconds
        last_done, last_t = 0, t0
        # Sample and report until every stream has finished its last request; the hard limit is one
        # request deadline past the end of the load (plus a margin): nothing can legitimately be later.
        hard_stop = stop_at + args.request_timeout + 30
        while not all(t.done() for t in tasks) and time.monotonic() < hard_stop:
            now = time.monotonic()
            if now >= next_sample:
                samples.append((now - t0, sample_rss(cluster)))
                next_sample += args.sample_seconds
            if now >= next_progress:
                done = len(tally.done)
                window = tally.done[last_done:]
                rate = sum(d.tokens for d in window) / max(1e-9, now - last_t)
                recent = [d.total for d in window] or [float("nan")]
                print(f"[{now - t0:6.0f} s] requests {done} (+{done - last_done}), in flight {tally.in_flight}, "
                      f"errors {sum(tally.errors.values())}, {rate:.0f} tok/s, total p50 {pct(recent, 50):.1f} s "
                      f"| RSS MB {fmt_rss(samples[-1][1])}", flush=True)
                last_done, last_t = done, now
                next_progress += args.progress_seconds
            await asyncio.sleep(0.5)
        cut_off = not all(t.done() for t in tasks)
        for t in tasks:
            t.cancel()
        for outcome in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(outcome, Exception):   # a client-side bug ended a stream: count it, loudly
                tally.errors[type(outcome).__name__] += 1
                tally.error_examples.setdefault(type(outcome).__name__, repr(outcome))
        samples.append((time.monotonic() - t0, sample_rss(cluster)))   # the end, before anything stops
    return tally, samples, min(time.monotonic(), stop_at) - t0, cut_off


# ---- report ------------------------------------------------------------------------------------
def report(args, tally: Tally, samples, load_seconds: float, cut_off: bool, setup: str) -> tuple[dict, list[str]]:
    """-> (figures, reasons to fail)."""
    done = tally.done
    tokens = sum(d.tokens for d in done)
    span = max((d.end for d in done), default=load_seconds)   # the last request ended after the load window
    latency = {name: {f"p{q}": pct([getattr(d, name) for d in done], q) for q in (50, 90, 99)}
               for name in ("ttft", "tpot", "total")}
    warm = args.warmup_minutes * 60
    after = [(t, s) for t, s in samples if t >= warm] or samples[-1:]
    base_t, base = after[0]
    end_t, end = samples[-1]
    rss = {}
    for label in end:
        series = [(t, s[label]) for t, s in after if label in s]
        start_mb = base.get(label, series[0][1] if series else end[label])
        rss[label] = {"start_mb": round(start_mb, 1), "end_mb": round(end[label], 1),
                      "growth_pct": round(100 * (end[label] - start_mb) / start_mb, 2),
                      "slope_mb_per_min": round(slope_per_minute(series), 3)}
    fails = []
    if tally.errors:
        fails.append(f"{sum(tally.errors.values())} requests failed: {dict(tally.errors)}")
    if cut_off:
        fails.append("streams still running one request deadline after the end: cut off")
    fails += [f"{label} RSS grew {r['growth_pct']:.1f}% (> {args.max_rss_growth:g}%)"
              for label, r in rss.items() if r["growth_pct"] > args.max_rss_growth]
    figures = {
        "setup": setup, "streams": args.streams, "minutes": args.minutes, "max_new_tokens": args.max_new_tokens,
        "requests_done": len(done), "errors": dict(tally.errors), "error_examples": tally.error_examples,
        "completion_tokens": tokens, "tokens_per_second": round(tokens / span, 1) if span else 0.0,
        "requests_per_second": round(len(done) / span, 2) if span else 0.0, "seconds": round(span, 1),
        "latency_seconds": latency, "requests_by_mode": dict(Counter(d.mode for d in done)),
        "rss_baseline_at_seconds": round(base_t, 1), "rss_end_at_seconds": round(end_t, 1), "rss": rss,
        "rss_samples": [{"t": round(t, 1), **{k: round(v, 1) for k, v in s.items()}} for t, s in samples],
        "passed": not fails, "failures": fails,
    }
    lines = [
        f"soak: {setup}",
        f"  {args.streams} streams, load {load_seconds / 60:.1f} min (last request ended at {span:.0f} s), "
        f"max_new_tokens {args.max_new_tokens}, modes {', '.join(m for m, *_ in MODES)} in turn",
        f"requests done: {len(done)}   errors: {sum(tally.errors.values())}"
        + (f" {dict(tally.errors)} e.g. {tally.error_examples}" if tally.errors else " (none)"),
        f"throughput: {figures['tokens_per_second']:.0f} completion tokens/s, "
        f"{figures['requests_per_second']:.2f} requests/s ({tokens} tokens)",
        "by mode: " + ", ".join(f"{m} {c}" for m, c in sorted(figures["requests_by_mode"].items())),
        f"{'latency (s)':<12}{'p50':>9}{'p90':>9}{'p99':>9}",
        *(f"  {name:<10}" + "".join(f"{v:9.3f}" for v in qs.values()) for name, qs in latency.items()),
        f"RSS (MB): baseline at {base_t:.0f} s (after {args.warmup_minutes:g} min warm-up), end at {end_t:.0f} s",
        f"  {'process':<18}{'start':>9}{'end':>9}{'growth':>9}{'MB/min':>9}",
        *(f"  {label:<18}{r['start_mb']:9.1f}{r['end_mb']:9.1f}{r['growth_pct']:8.1f}%{r['slope_mb_per_min']:9.2f}"
          for label, r in rss.items()),
        "result: " + ("PASS" if not fails else "FAIL: " + "; ".join(fails)),
    ]
    return figures, lines


def leftover_sequences(cluster: Cluster, timeout: float = 30.0) -> dict[str, int]:
    """Engine -> sequences it still holds once every request has ended (0 unless one leaked);
    waits a little for the last closes to arrive."""
    engines = [n for n in cluster.procs if n != "gateway"]
    deadline = time.monotonic() + timeout
    while True:
        held = {n: cluster.info(n).active_sequences for n in engines}
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.5)


def main() -> int:
    args = parse_args()
    # Services inherit these: a short drain when the soak stops them, and the start-up cost profile.
    os.environ.setdefault("SPECDEC_DRAIN_SECONDS", "5")
    os.environ["SPECDEC_COST_PROFILE"] = "1" if args.cost_profile else "0"
    work = Path(tempfile.mkdtemp(prefix="specdec-soak-"))
    log_dir = args.log_dir or work / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    target = make_checkpoint(work / "target", SHAPE, seed=args.seed)
    draft = make_layer_subset_draft(target, work / "draft", [0])
    slots = args.max_sequences or args.streams
    setup = (f"tiny random {SHAPE} target + 1-layer draft, {args.dtype} on cpu ({os.cpu_count()} cores), "
             f"{args.verifiers} verifier(s) + {args.drafters} drafter(s), {slots} KV slots each, "
             f"cost profile {'on' if args.cost_profile else 'off'}")
    print(f"starting the cluster ({setup}); logs in {log_dir}", flush=True)
    cluster = Cluster(target, draft, dtype=args.dtype, log_dir=log_dir, verifiers=args.verifiers,
                      drafters=args.drafters, extra=["--max-sequences", str(slots)],
                      gateway_extra=["--max-queue", str(4 * args.streams)])
    try:
        cluster.start()
        print(f"cluster up: {fmt_rss(sample_rss(cluster))} (RSS MB); {args.streams} streams for "
              f"{args.minutes:g} min", flush=True)
        tally, samples, load_seconds, cut_off = asyncio.run(run_load(cluster, args))
        died = {n: p.returncode for n, p in cluster.procs.items() if p.poll() is not None}
        held = leftover_sequences(cluster) if not died else {}
    finally:
        cluster.stop()
    figures, lines = report(args, tally, samples, load_seconds, cut_off, setup)
    figures["sequences_left"] = held
    lines.insert(-1, f"sequences held by the engines after the load: {held}")
    extra = ([f"processes died: {died}"] if died else []) + ([f"sequences leaked: {held}"] if any(held.values()) else [])
    if extra:
        figures["passed"] = False
        figures["failures"] += extra
        lines[-1] = "result: FAIL: " + "; ".join(figures["failures"])
    print("\n".join(lines), flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
