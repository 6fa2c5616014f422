"""Channels from the gateway to its backends: plaintext, or TLS (--backend-tls-*) with each
replica's certificate checked against the name its address was resolved from (replicas are dialled
by IP: `verifier:50061` may resolve to several)."""

from __future__ import annotations

import grpc

from specdec.security import TlsConfig, aio_channel, is_ip
from specdec.serving import CHANNEL_OPTIONS


class BackendDialer:
    def __init__(self, tls: TlsConfig | None = None) -> None:
        self.tls = tls if tls is not None and tls.enabled else None
        self._names: dict[str, str] = {}   # "10.0.0.5:50061" -> "verifier"

    def found(self, address: str, host: str) -> None:
        """`address` was resolved from `host` (the name its certificate must carry)."""
        if not is_ip(host):
            self._names[address] = host

    def channel(self, address: str) -> grpc.aio.Channel:
        return aio_channel(address, self.tls, CHANNEL_OPTIONS, self._names.get(address))
