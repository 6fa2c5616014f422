"""The same engines as real processes behind the gateway (the `specdec` commands, started with
tests/cluster.py's helpers): one verifier process shared by every acceptance value, and per
acceptance value a drafter process (`--controlled-acceptance FILE --acceptance A`) with its own
gateway over that drafter and the shared verifier, so one start serves the whole sweep. A wave of
requests is sent at once from one asyncio gRPC client, each streamed message time-stamped."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from benchmarks.grid import SpecConfig
from benchmarks.metrics import SeqTrace
from benchmarks.models import REPO, EngineSettings, ModelPair

sys.path.insert(0, str(REPO / "tests"))

from cluster import free_port, request, stop_all, wait_serving  # noqa: E402

from specdec.cpu_threads import serve_flags  # noqa: E402
from specdec.rpc import gateway_pb2_grpc  # noqa: E402

START_TIMEOUT = 900.0   # an 8B load, graph capture and first Triton compiles
REQUEST_TIMEOUT = 900.0


@dataclass(frozen=True)
class Placement:
    """Which GPUs each engine sees (CUDA_VISIBLE_DEVICES; None: all, as by default) and the
    verifier's tensor-parallel ranks: the disaggregated topology docker compose gives."""
    drafter_gpus: str | None = None
    verifier_gpus: str | None = None
    tp: int = 1

    def describe(self) -> str:
        if self.drafter_gpus is None and self.verifier_gpus is None and self.tp == 1:
            return "drafter and verifier share it"
        tp = f" (TP {self.tp})" if self.tp > 1 else ""
        return (f"drafter on GPU {self.drafter_gpus or 'all'}, "
                f"verifier on GPU {self.verifier_gpus or 'all'}{tp}")


class Services:
    def __init__(self, pair: ModelPair, device: str, dtype: str, settings: EngineSettings, log_dir: Path,
                 placement: Placement = Placement(), drafter_extra: tuple[str, ...] = (),
                 verifier_extra: tuple[str, ...] = ()) -> None:
        self.pair = pair
        self.drafter_extra = list(drafter_extra)   # e.g. --hedge-predrafts
        self.verifier_extra = list(verifier_extra)   # e.g. --fold-prefill
        self.base = [sys.executable, "-m", "specdec.cli"]
        self.engine_flags = ["--device", device, "--dtype", dtype, *settings.flags()]
        self.cpu = serve_flags()   # on the CPU, the cores shared as `specdec serve` does
        self.log_dir = log_dir
        self.placement = placement
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list = []
        self.addr: dict[str, str] = {}
        self.gateways: dict[float | None, str] = {}   # acceptance (None: real drafter) -> gateway address
        self.metrics: dict[str, str] = {}             # gateway address -> its /metrics HOST:PORT

    def _spawn(self, name: str, args: list[str], gpus: str | None = None) -> str:
        self.addr[name] = f"127.0.0.1:{free_port()}"
        log = open(self.log_dir / f"{name}.log", "w")
        self.logs.append(log)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **({} if gpus is None else {"CUDA_VISIBLE_DEVICES": gpus})}
        self.procs[name] = subprocess.Popen([*self.base, *args, "--listen", self.addr[name]], stdout=log,
                                            stderr=subprocess.STDOUT, env=env)
        return self.addr[name]

    def start_verifier(self) -> None:
        tp = ["--tp", str(self.placement.tp)] if self.placement.tp > 1 else []
        self._spawn("verifier", ["verifier", "--model", str(self.pair.target), *self.engine_flags, *tp,
                                 *self.cpu["verifier"], *self.pair.verifier_flags(), *self.verifier_extra],
                    self.placement.verifier_gpus)

    def add_gateway(self, acceptance: float | None, reference: Path | None = None, seed: int = 0) -> None:
        """A drafter (controlled when `reference` is given) and a gateway over it and the verifier."""
        tag = "real" if acceptance is None else f"a{acceptance:g}"
        control = ([] if reference is None else
                   ["--controlled-acceptance", str(reference), "--acceptance", str(acceptance),
                    "--acceptance-seed", str(seed)])
        drafter = self._spawn(f"drafter-{tag}", ["drafter", *self.pair.drafter_flags(), *self.engine_flags,
                                                 *self.cpu["drafter"], *self.drafter_extra, *control],
                              self.placement.drafter_gpus)
        metrics = f"127.0.0.1:{free_port()}"
        gateway = self._spawn(f"gateway-{tag}", [
            "gateway", "--target", str(self.pair.target), "--verifier", self.addr["verifier"], "--drafter", drafter,
            "--metrics-listen", metrics])
        self.gateways[acceptance] = gateway
        self.metrics[gateway] = metrics

    def wait_ready(self) -> None:
        for name, proc in self.procs.items():
            try:
                wait_serving(self.addr[name], START_TIMEOUT, proc)
            except (RuntimeError, TimeoutError) as exc:
                raise RuntimeError(f"{name} did not start: {exc}\n{self.log_tail(name)}") from exc

    def log_tail(self, name: str, lines: int = 30) -> str:
        text = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(f"  {name}| {line}" for line in text[-lines:])

    def stop(self) -> None:
        stop_all(list(self.procs.values()), timeout=30)
        self.procs.clear()
        for log in self.logs:
            log.close()
        self.logs.clear()


class GatewayClient:
    """Waves of concurrent streaming requests on one event loop (grpc.aio channels are bound to
    the loop that made them, so the loop lives as long as the client)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def close(self) -> None:
        self.loop.close()

    def run(self, address: str, prompts: list[list[int]], max_new: int, cfg: SpecConfig,
            warmup_tokens: int = 0, measuring: Callable[[], None] | None = None,
            clients: int | None = None) -> list[SeqTrace]:
        """`clients` concurrent clients (default: one per prompt, a single wave), each sending its next
        request as soon as its last one ended (client i takes prompts i, i + clients, ...): a closed
        loop at concurrency `clients`. -> traces in prompt order. measuring: called between the
        warm-up (one short request per client) and the measured requests (nothing in flight then)."""
        return self.loop.run_until_complete(self._load(address, prompts, max_new, cfg, warmup_tokens, measuring,
                                                       clients or len(prompts)))

    async def _load(self, address, prompts, max_new, cfg, warmup_tokens, measuring, clients) -> list[SeqTrace]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            if warmup_tokens:  # connection, allocations and the first steps of this shape
                await asyncio.gather(*(self._one(stub, p, warmup_tokens, cfg) for p in prompts[:clients]))
            if measuring is not None:
                measuring()
            traces: list[SeqTrace | None] = [None] * len(prompts)

            async def client(first: int) -> None:
                for i in range(first, len(prompts), clients):
                    traces[i] = await self._one(stub, prompts[i], max_new, cfg)

            await asyncio.gather(*(client(c) for c in range(clients)))
            return traces

    @staticmethod
    async def _one(stub, prompt: list[int], max_new: int, cfg: SpecConfig) -> SeqTrace:
        trace = SeqTrace(time.perf_counter())
        final = None
        req = request(prompt, max_new, cfg.mode, stop_at_eos=False, **cfg.request_fields())
        async for msg in stub.Generate(req, timeout=REQUEST_TIMEOUT):
            trace.arrived(time.perf_counter(), list(msg.token_ids))
            if msg.HasField("final"):
                final = msg.final
        st = final.stats
        trace.steps, trace.drafted, trace.accepted = st.steps, st.drafted, st.accepted
        trace.committed = round(st.mean_accepted_length * st.steps)
        trace.overlap_hits, trace.overlap_misses = st.overlap_hits, st.overlap_misses
        return trace
