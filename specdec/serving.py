"""Run a grpc.aio server on uvloop with the standard health service, server reflection (so grpcurl
and other generic tools work without the proto files) and a graceful drain on SIGINT/SIGTERM:
health turns NOT_SERVING, the owner's `drain` hook waits (up to its grace period) for in-flight
work to finish, then the server stops."""

from __future__ import annotations

import asyncio
import gc
import signal
from collections.abc import Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.security import TlsConfig

# Room for long prompts and, later, hidden-state payloads (EAGLE-3: ~24 KiB per token).
MESSAGE_LIMIT = 256 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MESSAGE_LIMIT),
    ("grpc.max_receive_message_length", MESSAGE_LIMIT),
]


def freeze_startup_objects(log) -> None:
    """Moves what start-up made (modules, the model, graphs: ~350k objects in a verifier) out of
    the garbage collector's reach, as the last step before SERVING. A full collection walks every
    tracked object: ~130 ms for a verifier on the 2-core dev VM. On the H100 two verify steps at
    batch 64 took 21-23 ms instead of 10.5 mid-run (a pause; which kind, the run did not show),
    and through auto's calibration they priced off at 29 ms a step there. Objects made while
    serving are still collected."""
    gc.collect()
    frozen = len(gc.get_objects())
    gc.freeze()
    log.info("start-up objects frozen out of garbage collection", objects=frozen)


class ServingState:
    """The health status of one process, updated by its owner."""

    def __init__(self) -> None:
        self.health = health.aio.HealthServicer()
        self.stopping = False  # once shutting down, nothing turns it back to SERVING

    async def set_serving(self, serving: bool) -> None:
        serving = serving and not self.stopping
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        await self.health.set("", status)


async def serve(
    listen: str,
    register: Callable[[grpc.aio.Server], None],
    service: str,
    log,
    on_start: Callable[[ServingState], Awaitable[None]] | None = None,
    drain: Callable[[], Awaitable[None]] | None = None,
    tls: TlsConfig | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    max_request_bytes: int | None = None,
) -> None:
    """service: the full name of the service `register` adds (listed by reflection); drain: awaited
    after a stop signal, before the server stops (it bounds its own wait); tls: plaintext if None;
    max_request_bytes: larger incoming messages end RESOURCE_EXHAUSTED (default MESSAGE_LIMIT)."""
    options = dict(CHANNEL_OPTIONS)
    if max_request_bytes is not None:
        options["grpc.max_receive_message_length"] = max_request_bytes
    server = grpc.aio.server(options=list(options.items()), interceptors=list(interceptors))
    register(server)
    state = ServingState()
    health_pb2_grpc.add_HealthServicer_to_server(state.health, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection([service, health_name, reflection.SERVICE_NAME], server)
    credentials = tls.server_credentials() if tls is not None else None
    bound = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
    if bound == 0:
        raise SystemExit(f"cannot listen on {listen}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if on_start is not None:
        await on_start(state)
    else:
        await state.set_serving(True)
    log.info("listening", address=listen, tls="off" if credentials is None else "mtls" if tls.ca else "on")
    await stop.wait()
    log.info("draining: not admitting new work")
    state.stopping = True
    await state.set_serving(False)
    if drain is not None:
        await drain()
    log.info("shutting down")
    await server.stop(grace=2.0)


async def wait_idle(busy: Callable[[], int], seconds: float, log, what: str) -> None:
    """Until busy() is 0 or `seconds` have passed (then what is left is cut off, and said)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := busy()) and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if left:
        log.warning(f"drain period over; {left} {what} cut off", drain_seconds=seconds)
    else:
        log.info(f"drained: no {what} left")


def run(main: Awaitable[None]) -> None:
    try:
        import uvloop

        uvloop.run(main)
    except ImportError:  # uvloop is optional off Linux
        asyncio.run(main)
