"""Clients of the internal services: one long-lived, ordered Step stream per backend."""

from __future__ import annotations

import asyncio

import grpc

from gateway.dialer import BackendDialer
from specdec.errors import STEP_FAILED_KEY
from specdec.rpc import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc


class BackendLost(RuntimeError):
    """The backend's stream broke: its sequences' state is gone with it. `failed`: the backend is
    up but its step failed (it ended the stream marked STEP_FAILED_KEY): retrying the same work
    elsewhere would fail the same way."""

    def __init__(self, message: str, failed: bool = False) -> None:
        super().__init__(message)
        self.failed = failed


class StepStream:
    def __init__(self, role: str, address: str, dialer: BackendDialer | None = None) -> None:
        self.role = role
        self.address = address
        self.channel = (dialer or BackendDialer()).channel(address)
        stub_cls = verifier_pb2_grpc.VerifierStub if role == "verifier" else drafter_pb2_grpc.DrafterStub
        self.stub = stub_cls(self.channel)
        self.call = None

    async def info(self, timeout: float = 5.0, wait: bool = False) -> common_pb2.ServiceInfo:
        return await self.stub.GetInfo(common_pb2.GetInfoRequest(), timeout=timeout, wait_for_ready=wait)

    async def step(self, msg):
        """Send one step and wait for its response; raises BackendLost if the stream broke."""
        try:
            if self.call is None:
                self.call = self.stub.Step()
            await self.call.write(msg)
            resp = await self.call.read()
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError, ConnectionError) as exc:
            # InvalidStateError: writing to a call the server already ended
            self.call = None
            failed = isinstance(exc, grpc.aio.AioRpcError) and step_failed(exc)
            raise BackendLost(f"{self.role} at {self.address}: {exc}", failed) from exc
        if resp is grpc.aio.EOF:
            self.call = None
            raise BackendLost(f"{self.role} at {self.address} ended the stream")
        if resp.step != msg.step:
            self.call = None
            raise BackendLost(f"{self.role} answered step {resp.step} to step {msg.step}")
        return resp

    def reset(self) -> None:
        """Drop the stream (the backend frees its sequences); the next step opens a new one."""
        if self.call is not None:
            self.call.cancel()
            self.call = None

    async def close(self) -> None:
        self.reset()
        await self.channel.close()


def step_failed(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the service ended the stream because its step failed, not because it went away
    (gRPC reports INTERNAL for both when a write meets a process that just died)."""
    metadata = exc.trailing_metadata() or ()
    return exc.code() == grpc.StatusCode.INTERNAL and any(key == STEP_FAILED_KEY for key, _ in metadata)
