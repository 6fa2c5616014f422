"""TLS for every link: server credentials (optionally requiring client certificates: mTLS) and
channel credentials for the gateway's backend links and the command-line clients.

Flags and environment variables, per role:
- every server: --tls-cert/--tls-key (SPECDEC_TLS_CERT/KEY) serve TLS; --tls-ca (SPECDEC_TLS_CA)
  also requires client certificates signed by that CA (mTLS);
- the gateway's links to its backends: --backend-tls-ca (SPECDEC_BACKEND_TLS_CA) turns TLS on and
  verifies the backends against it; --backend-tls-cert/--backend-tls-key present a client
  certificate (for backends that require mTLS);
- clients (`specdec generate`, `specdec health`): --tls (system roots), --tls-ca, --tls-cert, --tls-key,
  --tls-server-name (SPECDEC_CLIENT_TLS_*).
"""

from __future__ import annotations

import argparse
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import grpc

from specdec.env import env


@dataclass(frozen=True)
class TlsConfig:
    """PEM files. As a server: cert+key serve TLS, ca requires client certificates. As a client:
    ca (or the system roots, when only cert+key are set) verifies the server, cert+key are the
    client certificate."""

    cert: Path | None = None
    key: Path | None = None
    ca: Path | None = None

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, ca: str | None, flag: str) -> TlsConfig:
        """flag: the flags' prefix, for messages (e.g. '--tls' or '--backend-tls')."""
        if bool(cert) != bool(key):
            raise SystemExit(f"{flag}-cert and {flag}-key go together: give both or neither")
        paths = {name: Path(p) for name, p in (("cert", cert), ("key", key), ("ca", ca)) if p}
        for name, path in paths.items():
            if not path.is_file():
                raise SystemExit(f"{flag}-{name} {path}: no such file")
        return cls(**paths)

    @property
    def enabled(self) -> bool:
        return self.cert is not None or self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None: plaintext. With ca set, clients must present a certificate signed by it."""
        if self.cert is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.key.read_bytes(), self.cert.read_bytes())],
            root_certificates=self.ca.read_bytes() if self.ca else None,
            require_client_auth=self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca.read_bytes() if self.ca else None,
            private_key=self.key.read_bytes() if self.key else None,
            certificate_chain=self.cert.read_bytes() if self.cert else None)


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


def channel_options(base: list[tuple[str, object]], server_name: str | None) -> list[tuple[str, object]]:
    """`server_name`: the name the server's certificate is checked against when the address is an
    IP (replicas are dialled by the addresses their service name resolved to)."""
    return [*base, ("grpc.ssl_target_name_override", server_name)] if server_name else list(base)


def aio_channel(address: str, tls: TlsConfig | None, options: list, server_name: str | None = None) -> grpc.aio.Channel:
    if tls is None or not tls.enabled:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(), options=channel_options(options, server_name))


def add_server_tls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-cert", default=env("TLS_CERT"), metavar="PEM",
                   help="serve TLS with this certificate chain (env SPECDEC_TLS_CERT; default: plaintext)")
    p.add_argument("--tls-key", default=env("TLS_KEY"), metavar="PEM", help="its private key (env SPECDEC_TLS_KEY)")
    p.add_argument("--tls-ca", default=env("TLS_CA"), metavar="PEM",
                   help="require client certificates signed by this CA: mutual TLS (env SPECDEC_TLS_CA)")


def server_tls_from_args(a: argparse.Namespace) -> TlsConfig:
    tls = TlsConfig.from_flags(a.tls_cert, a.tls_key, a.tls_ca, "--tls")
    if tls.ca is not None and tls.cert is None:
        raise SystemExit("--tls-ca (client certificates) needs --tls-cert and --tls-key")
    return tls


def add_backend_tls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend-tls-ca", default=env("BACKEND_TLS_CA"), metavar="PEM",
                   help="connect to verifiers and drafters over TLS, verifying them against this CA; their "
                        "certificates must name the host given in --verifier/--drafter (env SPECDEC_BACKEND_TLS_CA)")
    p.add_argument("--backend-tls-cert", default=env("BACKEND_TLS_CERT"), metavar="PEM",
                   help="client certificate for backends that require mTLS (env SPECDEC_BACKEND_TLS_CERT)")
    p.add_argument("--backend-tls-key", default=env("BACKEND_TLS_KEY"), metavar="PEM",
                   help="its private key (env SPECDEC_BACKEND_TLS_KEY)")


def backend_tls_from_args(a: argparse.Namespace) -> TlsConfig:
    tls = TlsConfig.from_flags(a.backend_tls_cert, a.backend_tls_key, a.backend_tls_ca, "--backend-tls")
    if tls.cert is not None and tls.ca is None:
        raise SystemExit("--backend-tls-cert needs --backend-tls-ca (the CA that signed the backends' certificates)")
    return tls


def add_client_tls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls", action="store_true", default=env("CLIENT_TLS", "0") not in ("0", "false", "no"),
                   help="connect over TLS, verified against the system roots (or --tls-ca) (env SPECDEC_CLIENT_TLS=1)")
    p.add_argument("--tls-ca", default=env("CLIENT_TLS_CA"), metavar="PEM",
                   help="connect over TLS, verifying the server against this CA (env SPECDEC_CLIENT_TLS_CA)")
    p.add_argument("--tls-cert", default=env("CLIENT_TLS_CERT"), metavar="PEM",
                   help="client certificate, for a server that requires mTLS (env SPECDEC_CLIENT_TLS_CERT)")
    p.add_argument("--tls-key", default=env("CLIENT_TLS_KEY"), metavar="PEM", help="its key (env SPECDEC_CLIENT_TLS_KEY)")
    p.add_argument("--tls-server-name", default=env("CLIENT_TLS_SERVER_NAME"),
                   help="the name to check the server's certificate against, when it differs from the address's "
                        "host (env SPECDEC_CLIENT_TLS_SERVER_NAME)")


def client_tls_from_args(a: argparse.Namespace) -> TlsConfig | None:
    """None: plaintext (no client TLS flag given)."""
    tls = TlsConfig.from_flags(a.tls_cert, a.tls_key, a.tls_ca, "--tls")
    return tls if a.tls or tls.enabled else None


def blocking_channel(address: str, tls: TlsConfig | None, server_name: str | None = None) -> grpc.Channel:
    """For the command-line clients; tls None: plaintext."""
    if tls is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, tls.channel_credentials(), options=channel_options([], server_name))
