"""Channels from the gateway to its backends: plaintext, or TLS (--backend-tls-*) with each
replica's certificate checked against the name its address was resolved from (replicas are dialled
by IP: `verifier:50061` may resolve to several)."""

from __future__ import annotations

import grpc

from specdec.security import TlsConfig, aio_channel, is_ip
from specdec.serving import CHANNEL_OPTIONS

# A replica restarted on its address must be seen again within about a second: with gRPC's default
# reconnect backoff (growing to 120 s while it is down) the gateway noticed a verifier back after a
# 50 s outage only at the next attempt, tens of seconds later, and requests waiting for it
# (--backend-wait-seconds) ended UNAVAILABLE meanwhile. One connection attempt a second to a
# replica that is down costs nothing.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 1000), ("grpc.max_reconnect_backoff_ms", 1000)]


class BackendDialer:
    def __init__(self, tls: TlsConfig | None = None) -> None:
        self.tls = tls if tls is not None and tls.enabled else None
        self._names: dict[str, str] = {}   # "10.0.0.5:50061" -> "verifier"

    def found(self, address: str, host: str) -> None:
        """`address` was resolved from `host` (the name its certificate must carry)."""
        if not is_ip(host):
            self._names[address] = host

    def channel(self, address: str) -> grpc.aio.Channel:
        return aio_channel(address, self.tls, CHANNEL_OPTIONS + RECONNECT_OPTIONS, self._names.get(address))
