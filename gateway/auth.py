"""Bearer-token authentication on the gateway's public port.

Tokens come from a file (one per line; blank lines and '#' comments ignored; re-read when it
changes, so tokens rotate without a restart) and/or SPECDEC_AUTH_TOKENS (comma-separated). A call
must carry the metadata `authorization: Bearer <token>`; otherwise it ends UNAUTHENTICATED before
any work is done. Health checks stay open (container and load-balancer probes carry no token);
reflection needs a token like everything else.
"""

from __future__ import annotations

import hmac
import time
from pathlib import Path

import grpc
import structlog

from gateway import metrics

OPEN_METHODS = ("/grpc.health.v1.Health/",)
RELOAD_CHECK_SECONDS = 1.0
HOW_TO = "send the metadata 'authorization: Bearer <token>' with a token the gateway was given"


def read_token_file(path: Path) -> tuple[str, ...]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return tuple(line for line in lines if line and not line.startswith("#"))


class BearerTokens:
    def __init__(self, file: Path | None, inline: tuple[str, ...] = ()) -> None:
        self.file, self.inline = file, tuple(t for t in inline if t)
        self.log = structlog.get_logger(service="gateway")
        self._from_file: tuple[str, ...] = ()
        self._mtime: float | None = None
        self._checked = 0.0
        if file is not None:
            try:
                self._load()
            except OSError as exc:
                raise SystemExit(f"--auth-tokens-file {file}: {exc}") from exc
        if not self.tokens():
            raise SystemExit("authentication is on but no token was given: the tokens file is empty")

    def _load(self) -> None:
        mtime = self.file.stat().st_mtime
        if mtime != self._mtime:
            self._from_file, self._mtime = read_token_file(self.file), mtime
            self.log.info("auth tokens loaded", file=str(self.file), tokens=len(self._from_file))

    def tokens(self) -> tuple[str, ...]:
        now = time.monotonic()
        if self.file is not None and now - self._checked >= RELOAD_CHECK_SECONDS:
            self._checked = now
            try:
                self._load()
            except OSError as exc:   # keep the last good set: a half-written rotation must not lock everyone out
                self.log.warning("auth tokens file unreadable; keeping the previous tokens", error=str(exc))
        return self._from_file + self.inline

    def valid(self, token: str) -> bool:
        given = token.encode()
        # Compare against every token, in constant time each: no early exit that timing could reveal.
        return sum(hmac.compare_digest(given, t.encode()) for t in self.tokens()) > 0


def bearer_token(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
    return None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: BearerTokens) -> None:
        self.tokens = tokens
        self.log = structlog.get_logger(service="gateway")

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        token = bearer_token(details.invocation_metadata)
        if token is not None and self.tokens.valid(token):
            return handler
        why = "no bearer token" if token is None else "an unknown bearer token"
        self.log.warning("call refused: not authenticated", method=details.method, reason=why)
        if details.method.endswith("/Generate"):
            metrics.REQUESTS.labels("UNAUTHENTICATED").inc()
        return denied(handler, f"{why}: {HOW_TO}")


def denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call UNAUTHENTICATED."""

    async def deny(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    make = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler, (True, True): grpc.stream_stream_rpc_method_handler}
    return make[(handler.request_streaming, handler.response_streaming)](
        deny, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
