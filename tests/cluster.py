"""Start gateway, drafter and verifier as real processes (the `specdec` commands) for tests."""

from __future__ import annotations

import itertools
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.cpu_threads import serve_flags
from specdec.rpc import common_pb2, drafter_pb2_grpc, gateway_pb2, gateway_pb2_grpc, verifier_pb2_grpc

START_TIMEOUT = 180.0


# Test services listen below the kernel's ephemeral range (32768+), where no client socket or bind(0)
# lands, each pytest-xdist worker in a block of its own: a port picked by asking the kernel for a free
# one could be handed to the other worker before our service bound it, and a health check would then
# reach the other worker's server. A random start in the block keeps two test sessions run side by
# side (by hand) from walking the same ports in step.
_PORT_BLOCK = 2000
_worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_next_port = itertools.count(random.randrange(_PORT_BLOCK))


def free_port() -> int:
    """A loopback port nobody listens on, from this worker's block."""
    base = 20000 + (_worker % 6) * _PORT_BLOCK
    for _ in range(_PORT_BLOCK):
        port = base + next(_next_port) % _PORT_BLOCK
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}..{base + _PORT_BLOCK - 1}")


def stop_all(procs, timeout: float) -> None:
    """SIGTERM every running process, then wait for each; SIGKILL what outlives `timeout`."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()


def wait_serving(address: str, timeout: float = START_TIMEOUT, proc: subprocess.Popen | None = None,
                 channel=grpc.insecure_channel) -> None:
    """channel: opens the channel to `address` (a TLS one for services that serve TLS)."""
    deadline = time.monotonic() + timeout
    with channel(address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process for {address} exited with {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} did not become SERVING within {timeout}s")


class Cluster:
    """One gateway over `verifiers` verifier and `drafters` drafter replicas (names: verifier,
    verifier.1, ..., drafter, drafter.1, ...), all on loopback."""

    def __init__(self, target: Path, draft: Path | None, device: str = "cpu", dtype: str = "float64",
                 log_dir: Path | None = None, extra: list[str] | None = None,
                 verifier_extra: list[str] | None = None, verifiers: int = 1, drafters: int = 1,
                 drafter_extra: list[str] | None = None,
                 gateway_extra: list[str] | None = None, hold: bool = False,
                 credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None,
                 token: str | None = None, backend_host: str = "127.0.0.1") -> None:
        """credentials (and the name the certificates carry, server_name): how the test talks to
        services that serve TLS; token: the bearer token sent with the test's Generate calls;
        backend_host: the name the gateway is given for its backends (they listen on 127.0.0.1)."""
        self.credentials, self.server_name = credentials, server_name
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        base = [sys.executable, "-m", "specdec.cli"]
        dev = ["--device", device, "--dtype", dtype, *(extra or [])]
        cpu = serve_flags()   # the cores shared as `specdec serve` does (flags in *_extra come later and win)
        names = {"verifier": [replica_name("verifier", i) for i in range(verifiers)],
                 "drafter": [replica_name("drafter", i) for i in range(drafters if draft else 0)]}
        self.addr = {name: f"127.0.0.1:{free_port()}" for name in ["gateway", *names["verifier"], *names["drafter"]]}
        self.commands = {}
        for name in names["verifier"]:
            self.commands[name] = [*base, "verifier", "--model", str(target), "--listen", self.addr[name], *dev,
                                   *cpu["verifier"], *(verifier_extra or [])]
        for name in names["drafter"]:
            self.commands[name] = [*base, "drafter", "--model", str(draft), "--listen", self.addr[name], *dev,
                                   *cpu["drafter"], *(drafter_extra or [])]
        # The gateway's test-only hold hook (gateway/hold.py): see hold() and release().
        self.hold_dir = Path(tempfile.mkdtemp(prefix="specdec-hold-")) if hold else None
        self.commands["gateway"] = [
            *base, "gateway", "--listen", self.addr["gateway"], "--target", str(target),
            "--verifier", ",".join(self.addr[n].replace("127.0.0.1", backend_host) for n in names["verifier"]),
            "--drafter", ",".join(self.addr[n].replace("127.0.0.1", backend_host) for n in names["drafter"]) or "none",
            *(gateway_extra or []),
            *(["--test-hold-dir", str(self.hold_dir)] if hold else []),
        ]
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self) -> Cluster:
        for name in self.commands:  # backends first, the gateway last
            if name == "gateway":  # like compose's depends_on: service_healthy
                for backend, proc in self.procs.items():
                    wait_serving(self.addr[backend], proc=proc, channel=self.open_channel)
            self._spawn(name)
        wait_serving(self.addr["gateway"], proc=self.procs["gateway"], channel=self.open_channel)
        self.channel = self.open_channel(self.addr["gateway"])
        self.gateway = gateway_pb2_grpc.GatewayStub(self.channel)
        return self

    def open_channel(self, address: str) -> grpc.Channel:
        if self.credentials is None:
            return grpc.insecure_channel(address)
        options = [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
        return grpc.secure_channel(address, self.credentials, options=options)

    def hold(self, request_id: str, after_tokens: int) -> None:
        """Every sample of `request_id` stops advancing once it has generated `after_tokens`."""
        (self.hold_dir / request_id).write_text(str(after_tokens))

    def release(self, request_id: str) -> None:
        (self.hold_dir / request_id).unlink(missing_ok=True)

    def _spawn(self, name: str) -> None:
        out = open(self.log_dir / f"{name}.log", "a") if self.log_dir else subprocess.DEVNULL
        self.procs[name] = subprocess.Popen(self.commands[name], stdout=out, stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def restart(self, name: str) -> None:
        """Start a killed service again on its address; returns once it is SERVING."""
        self._spawn(name)
        wait_serving(self.addr[name], proc=self.procs[name], channel=self.open_channel)

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait()

    def stop(self) -> None:
        stop_all(self.procs.values(), timeout=15)

    def info(self, name: str) -> common_pb2.ServiceInfo:
        stub_cls = verifier_pb2_grpc.VerifierStub if name.startswith("verifier") else drafter_pb2_grpc.DrafterStub
        with self.open_channel(self.addr[name]) as ch:
            return stub_cls(ch).GetInfo(common_pb2.GetInfoRequest(), timeout=10)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, mode: str = "chain", timeout: float = 120,
                 sampling: dict | None = None, request_id: str = "", **spec) -> tuple[list[int], gateway_pb2.FinalInfo]:
        req = request(prompt_ids, max_new_tokens, mode, **spec)
        req.request_id = request_id
        if sampling:
            req.sampling.CopyFrom(gateway_pb2.Sampling(**sampling))
        ids: list[int] = []
        final = None
        for msg in self.gateway.Generate(req, timeout=timeout, metadata=self.metadata):
            ids += msg.token_ids
            if msg.HasField("final"):
                final = msg.final
        return ids, final


def replica_name(role: str, index: int) -> str:
    return role if index == 0 else f"{role}.{index}"


MODES = {"default": gateway_pb2.SPEC_MODE_UNSPECIFIED, "auto": gateway_pb2.SPEC_MODE_AUTO,
         "chain": gateway_pb2.SPEC_MODE_CHAIN, "tree": gateway_pb2.SPEC_MODE_TREE, "off": gateway_pb2.SPEC_MODE_OFF}


def request(prompt_ids: list[int], max_new_tokens: int, mode: str = "chain", stop_at_eos: bool = False,
            **spec) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIdList(ids=prompt_ids), max_new_tokens=max_new_tokens,
        stop_at_eos=stop_at_eos, speculation=gateway_pb2.SpeculationConfig(mode=MODES[mode], **spec),
    )
