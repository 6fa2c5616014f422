"""The gateway's Step stream tells a service whose step failed (it ends the stream marked
STEP_FAILED_KEY: the gateway fails those requests) from one that went away (gRPC may report that
as INTERNAL too, "Failed execute_batch", when a write meets a process that just died: the
gateway must resume those requests, not fail them). Real gRPC, in one process."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import structlog

from gateway.backends import BackendLost, StepStream
from specdec.rpc import common_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.sequence_table import SequenceTable
from verifier_svc.servicer import VerifierServicer


class FailingEngine:
    """An engine whose step raises (a bug, not bad input)."""

    table = SequenceTable(4, 16, 64)

    def step(self, req):
        raise RuntimeError("a bug in the step")

    def close(self, seq_ids):
        pass


class BareInternal(verifier_pb2_grpc.VerifierServicer):
    """Ends the stream INTERNAL without the mark, as gRPC reports a write to a dead process."""

    async def Step(self, request_iterator, context):
        async for _ in request_iterator:
            await context.abort(grpc.StatusCode.INTERNAL, 'Failed "execute_batch"')
            yield  # (never reached: makes this a stream handler)


async def step_against(servicer) -> BackendLost:
    server = grpc.aio.server()
    verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stream = StepStream("verifier", f"127.0.0.1:{port}")
    try:
        with pytest.raises(BackendLost) as lost:
            await stream.step(verifier_pb2.VerifyStepRequest(step=1))
        return lost.value
    finally:
        await stream.close()
        await server.stop(None)


def test_a_failed_step_is_told_from_a_lost_backend():
    info = common_pb2.ServiceInfo(role="verifier")
    with ThreadPoolExecutor(1) as executor:
        failed = asyncio.run(step_against(VerifierServicer(FailingEngine(), info, structlog.get_logger(), executor)))
    assert failed.failed and "step failed: a bug in the step" in str(failed)
    lost = asyncio.run(step_against(BareInternal()))
    assert not lost.failed and "execute_batch" in str(lost)
