"""Backend replicas: addresses from a list and from DNS names that resolve to many (what
`docker compose --scale` produces), re-resolved and health-checked periodically."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass, field

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.dialer import BackendDialer
from specdec.rpc import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc

HEALTH_TIMEOUT = 2.0


@dataclass
class Replica:
    role: str
    address: str                     # ip:port
    healthy: bool = False
    info: common_pb2.ServiceInfo | None = None
    load: int = 0                    # requests pinned to it right now
    dialer: BackendDialer = field(default_factory=BackendDialer, repr=False)
    channel: grpc.aio.Channel | None = field(default=None, repr=False)

    async def probe(self) -> bool:
        """Health check, and the service info on first success; -> healthy."""
        if self.channel is None:
            self.channel = self.dialer.channel(self.address)
        try:
            resp = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=HEALTH_TIMEOUT)
            healthy = resp.status == health_pb2.HealthCheckResponse.SERVING
            if healthy and self.info is None:
                stub_cls = verifier_pb2_grpc.VerifierStub if self.role == "verifier" else drafter_pb2_grpc.DrafterStub
                self.info = await stub_cls(self.channel).GetInfo(common_pb2.GetInfoRequest(), timeout=HEALTH_TIMEOUT)
        except grpc.aio.AioRpcError:
            healthy = False
        self.healthy = healthy
        return healthy


def split_targets(spec: str) -> list[tuple[str, int]]:
    """'a:1,b:2,[::1]:3' -> [('a', 1), ('b', 2), ('::1', 3)]."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"address {item!r} must be HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    return out


async def resolve(targets: list[tuple[str, int]]) -> dict[str, str]:
    """-> {address: the host name it was resolved from}."""
    loop = asyncio.get_running_loop()
    found: dict[str, str] = {}
    for host, port in targets:
        try:
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            continue  # not resolvable right now (a scaled-down service): try again next round
        for family, *_, sockaddr in infos:
            ip = sockaddr[0]
            found[f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"] = host
    return found


class ReplicaSet:
    def __init__(self, role: str, spec: str, dialer: BackendDialer | None = None) -> None:
        self.role = role
        self.dialer = dialer or BackendDialer()
        self.targets = split_targets(spec)
        self.replicas: dict[str, Replica] = {}
        self.log = structlog.get_logger(service="gateway")

    async def refresh(self) -> None:
        """Re-resolve the names, then health-check every replica."""
        addresses = await resolve(self.targets)
        for addr in addresses.keys() - self.replicas.keys():
            self.dialer.found(addr, addresses[addr])
            self.replicas[addr] = Replica(self.role, addr, dialer=self.dialer)
            self.log.info("replica found", role=self.role, address=addr)
        for addr in self.replicas.keys() - addresses:
            replica = self.replicas[addr]
            if replica.load == 0:  # keep gone replicas while requests are pinned to them
                del self.replicas[addr]
                self.log.info("replica gone", role=self.role, address=addr)
            replica.healthy = False
        for replica in [self.replicas[a] for a in addresses]:
            was = replica.healthy
            if await replica.probe() != was:
                self.log.info("replica healthy" if replica.healthy else "replica unhealthy",
                              role=self.role, address=replica.address)

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy]

    def least_loaded(self, usable=lambda replica: True) -> Replica | None:
        return min((r for r in self.healthy() if usable(r)), key=lambda r: r.load, default=None)

    def mark_down(self, address: str) -> None:
        replica = self.replicas.get(address)
        if replica is not None and replica.healthy:
            replica.healthy = False
            self.log.warning("replica marked down", role=self.role, address=address)
