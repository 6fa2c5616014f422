"""The gateway alone: its per-step cost and the transport's at each concurrency, with the engines
replaced by stand-ins that sleep a modelled step time (benchmarks/stand_in.py: the real servicers
and step streams, no model). Whatever a loop step costs above the stand-ins' engine time is the
gateway's and the wire's, on any machine, at any C, without a GPU.

For each mode and C: tok/s, the loop step and its split from the gateway's /metrics (engine time,
transport = round trips less engine time, the gateway's own time), and "engine-bound tok/s": what
the same steps would give if the loop step were only the engine time.

    python scripts/bench_gateway.py --concurrency 1 8 32 --modes off "chain k=4 no-overlap" "chain k=4"
    python scripts/bench_gateway.py --concurrency 32 --aux-width 12288   # EAGLE-3 hidden states of an 8B
    python scripts/bench_gateway.py --concurrency 32 --aux-width 12288 --hidden-states-fp8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from cluster import free_port, stop_all, wait_serving  # noqa: E402
from model_factory import VOCAB, make_tokenizer  # noqa: E402

from benchmarks import step_split  # noqa: E402
from benchmarks.gateway_runs import GatewayClient  # noqa: E402
from benchmarks.grid import CONFIGS, SpecConfig  # noqa: E402
from benchmarks.host_speed import describe  # noqa: E402
from benchmarks.metrics import RunResult, summarize  # noqa: E402

AUTO = SpecConfig("auto", "auto")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--modes", nargs="+", default=["off", "chain k=4 no-overlap", "chain k=4"],
                   help=f"rows: auto or any of {', '.join(CONFIGS)}")
    p.add_argument("--requests-per-client", type=int, default=4, help="closed loop: requests each client sends")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--acceptance", type=float, default=0.8)
    p.add_argument("--verify-ms", type=float, nargs="+", default=[8.0, 0.01], metavar="MS",
                   help="the verifier stand-in's step: BASE PER_ROW [PROMPT] = base + per_row x rows (+ prompt in "
                        "a step that takes in a prompt), ms; H100, 8B bf16 ~ 8 0.01 7.5")
    p.add_argument("--draft-ms", type=float, nargs="+", default=[1.0, 0.03], metavar="MS",
                   help="the drafter stand-in's step, the same way (ms); H100, 1B drafter ~ 6 0.02 3")
    p.add_argument("--aux-width", type=int, default=0,
                   help="hidden-state values per committed position (EAGLE-3: 3 x hidden; 8B: 12288)")
    p.add_argument("--hidden-states-fp8", action="store_true", help="those rows packed to float8 (half the bytes)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--log-dir", type=Path, help="keep the services' logs here (default: a temporary directory)")
    return p.parse_args(argv)


def step_time(ms: list[float]) -> list[str]:
    """BASE PER_ROW [PROMPT] -> a stand-in's flags."""
    if len(ms) not in (2, 3):
        raise SystemExit("--verify-ms / --draft-ms take BASE PER_ROW [PROMPT]")
    return [f"--{name}-ms={value}" for name, value in zip(("base", "per-row", "prompt"), ms)]


class StandInCluster:
    """Stand-in verifier and drafter processes and a real gateway over them."""

    def __init__(self, a: argparse.Namespace, work: Path) -> None:
        make_tokenizer(work)
        self.procs: dict[str, tuple[subprocess.Popen, str]] = {}   # name -> (process, its address)
        self.work = work
        self.logs = []
        engine = [sys.executable, "-m", "benchmarks.stand_in", "--vocab", str(VOCAB), "--aux-width", str(a.aux_width)]
        verifier = self._spawn("verifier", [*engine, "--role", "verifier", *step_time(a.verify_ms),
                                            *(["--hidden-states-fp8"] if a.hidden_states_fp8 else [])])
        drafter = self._spawn("drafter", [*engine, "--role", "drafter", *step_time(a.draft_ms),
                                          "--acceptance", str(a.acceptance)])
        self.metrics = f"127.0.0.1:{free_port()}"
        self.gateway = self._spawn("gateway", [sys.executable, "-m", "specdec.cli", "gateway", "--tokenizer", str(work),
                                               "--verifier", verifier, "--drafter", drafter,
                                               "--metrics-listen", self.metrics])
        for proc, address in self.procs.values():
            wait_serving(address, 120, proc)

    def _spawn(self, name: str, argv: list[str]) -> str:
        address = f"127.0.0.1:{free_port()}"
        self.logs.append(log := open(self.work / f"{name}.log", "w"))
        self.procs[name] = (subprocess.Popen([*argv, "--listen", address], cwd=REPO, stdout=log,
                                             stderr=subprocess.STDOUT), address)
        return address

    def stop(self) -> None:
        stop_all([proc for proc, _ in self.procs.values()], timeout=10)
        for log in self.logs:
            log.close()


def auto_choices(metrics: str) -> dict[str, float]:
    """The gateway's sequence steps per `--mode auto` choice so far (its /metrics)."""
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    return {s.labels["choice"]: s.value for family in text_string_to_metric_families(text)
            if family.name == "specdec_gateway_auto_steps" for s in family.samples if s.name.endswith("_total")}


def share_text(before: dict[str, float], after: dict[str, float]) -> str:
    steps = {c: after[c] - before.get(c, 0.0) for c in after if after[c] > before.get(c, 0.0)}
    total = sum(steps.values())
    return ", ".join(f"{c} {n / total:.0%}" for c, n in sorted(steps.items(), key=lambda x: -x[1]))


def main(argv: list[str] | None = None) -> list[RunResult]:
    a = parse(argv)
    configs = [AUTO if m == "auto" else CONFIGS[m] for m in a.modes]
    prompts = [[3 + (7 * i + j) % (VOCAB - 3) for j in range(a.prompt_len)]
               for i in range(max(a.concurrency) * a.requests_per_client)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = a.log_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        cluster = StandInCluster(a, work)
        client = GatewayClient()
        try:
            # The stand-ins' figures are the host's Python and gRPC: say which host (benchmarks/host_speed.py).
            print(f"host: {describe()}", flush=True)
            print(f"{'C':>3} {'mode':<22} {'tok/s':>8} {'x off':>6} {'accept':>6} {'loop ms':>8} {'engine':>7} "
                  f"{'transp':>7} {'gateway':>7} {'eng-bound tok/s':>15}", flush=True)
            for c in a.concurrency:
                off = None
                for cfg in configs:
                    marks = {}

                    def measuring() -> None:
                        marks.update(before=step_split.scrape(cluster.metrics), choices=auto_choices(cluster.metrics))

                    traces = client.run(cluster.gateway, prompts[: c * a.requests_per_client], a.max_new_tokens, cfg,
                                        warmup_tokens=4, clients=c, measuring=measuring)
                    res = summarize(traces, "gateway", "stand-in", cfg.name, c, a.acceptance,
                                    **step_split.split(marks["before"], step_split.scrape(cluster.metrics)))
                    off = res.tok_s if cfg.name == "off" else off
                    engine = (res.verify_ms or 0) + (res.draft_engine_ms or 0)
                    bound = res.tok_s * res.loop_step_ms / engine if engine else float("nan")
                    print(f"{c:>3} {cfg.name:<22} {res.tok_s:>8.1f} {res.tok_s / off if off else float('nan'):>6.2f} "
                          f"{res.accept_len:>6.2f} {res.loop_step_ms:>8.2f} {engine:>7.2f} {res.transport_ms:>7.2f} "
                          f"{res.gateway_ms:>7.2f} {bound:>15.1f}", flush=True)
                    if cfg.mode == "auto":
                        print(f"      auto chose: {share_text(marks['choices'], auto_choices(cluster.metrics))}",
                              flush=True)
                    rows.append(res)
        finally:
            client.close()
            cluster.stop()
    if a.json:
        a.json.write_text(json.dumps([r.to_json() for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
