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
from pathlib import Path

import grpc

from benchmarks.grid import SpecConfig
from benchmarks.metrics import SeqTrace
from benchmarks.models import REPO, EngineSettings, ModelPair

sys.path.insert(0, str(REPO / "tests"))

from cluster import free_port, request, stop_all, wait_serving  # noqa: E402

from specdec.rpc import gateway_pb2_grpc  # noqa: E402

START_TIMEOUT = 900.0   # an 8B load, graph capture and first Triton compiles
REQUEST_TIMEOUT = 900.0


class Services:
    def __init__(self, pair: ModelPair, device: str, dtype: str, settings: EngineSettings, log_dir: Path) -> None:
        self.pair = pair
        self.base = [sys.executable, "-m", "specdec.cli"]
        self.engine_flags = ["--device", device, "--dtype", dtype, *settings.flags()]
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list = []
        self.addr: dict[str, str] = {}
        self.gateways: dict[float | None, str] = {}   # acceptance (None: real drafter) -> gateway address

    def _spawn(self, name: str, args: list[str]) -> str:
        self.addr[name] = f"127.0.0.1:{free_port()}"
        log = open(self.log_dir / f"{name}.log", "w")
        self.logs.append(log)
        self.procs[name] = subprocess.Popen([*self.base, *args, "--listen", self.addr[name]], stdout=log,
                                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self.addr[name]

    def start_verifier(self) -> None:
        self._spawn("verifier", ["verifier", "--model", str(self.pair.target), *self.engine_flags,
                                 *self.pair.verifier_flags()])

    def add_gateway(self, acceptance: float | None, reference: Path | None = None, seed: int = 0) -> None:
        """A drafter (controlled when `reference` is given) and a gateway over it and the verifier."""
        tag = "real" if acceptance is None else f"a{acceptance:g}"
        control = ([] if reference is None else
                   ["--controlled-acceptance", str(reference), "--acceptance", str(acceptance),
                    "--acceptance-seed", str(seed)])
        drafter = self._spawn(f"drafter-{tag}", ["drafter", *self.pair.drafter_flags(), *self.engine_flags, *control])
        self.gateways[acceptance] = self._spawn(f"gateway-{tag}", [
            "gateway", "--target", str(self.pair.target), "--verifier", self.addr["verifier"], "--drafter", drafter])

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
            warmup_tokens: int = 0) -> list[SeqTrace]:
        return self.loop.run_until_complete(self._wave(address, prompts, max_new, cfg, warmup_tokens))

    async def _wave(self, address, prompts, max_new, cfg, warmup_tokens) -> list[SeqTrace]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GatewayStub(channel)
            if warmup_tokens:  # connection, allocations and the first steps of this shape
                await asyncio.gather(*(self._one(stub, p, warmup_tokens, cfg) for p in prompts))
            return list(await asyncio.gather(*(self._one(stub, p, max_new, cfg) for p in prompts)))

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
