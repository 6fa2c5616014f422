"""gRPC servicer of the verifier: protobuf <-> engine dataclasses, engine work on its own thread."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc

from specdec.rpc import common_pb2, verifier_pb2, verifier_pb2_grpc
from specdec.rpc.convert import error_to_proto, tree_from_proto
from verifier_svc.engine import VerifierEngine
from verifier_svc.types import OpenSequence, VerifierStep, VerifierStepResult, VerifyItem


def step_from_proto(msg: verifier_pb2.VerifyStepRequest) -> VerifierStep:
    return VerifierStep(
        step=msg.step,
        open=[OpenSequence(o.seq_id, list(o.prompt_ids)) for o in msg.open],
        verify=[VerifyItem(v.seq_id, v.committed_len, tree_from_proto(v.draft)) for v in msg.verify],
        close=list(msg.close),
    )


def result_to_proto(res: VerifierStepResult) -> verifier_pb2.VerifyStepResponse:
    return verifier_pb2.VerifyStepResponse(
        step=res.step,
        verdicts=[
            verifier_pb2.Verdict(seq_id=v.seq_id, committed_len=v.committed_len,
                                 accepted_ids=v.accepted_ids, accepted_drafts=v.accepted_drafts)
            for v in res.verdicts
        ],
        errors=[error_to_proto(e) for e in res.errors],
    )


class VerifierServicer(verifier_pb2_grpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine, info: common_pb2.ServiceInfo, log,
                 executor: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.info = info
        self.log = log
        self.executor = executor  # the one thread that runs the engine (and its collectives)
        self.open_streams = 0

    async def Step(self, request_iterator, context: grpc.aio.ServicerContext):
        loop = asyncio.get_running_loop()
        owned: set[str] = set()  # sequences opened on this stream: freed when it ends
        self.open_streams += 1
        try:
            async for msg in request_iterator:
                req = step_from_proto(msg)
                owned -= set(req.close)
                try:
                    res = await loop.run_in_executor(self.executor, self.engine.step, req)
                except Exception as exc:  # a bug, not bad input: end this stream loudly
                    self.log.exception("verifier step failed", step=req.step)
                    await context.abort(grpc.StatusCode.INTERNAL, f"verifier step failed: {exc}")
                failed = {e.seq_id for e in res.errors}
                owned |= {o.seq_id for o in req.open if o.seq_id not in failed}
                yield result_to_proto(res)
        finally:
            self.open_streams -= 1
            if owned:
                self.log.info("stream ended; freeing its sequences", count=len(owned))
                await loop.run_in_executor(self.executor, self.engine.close, sorted(owned))

    async def GetInfo(self, request, context) -> common_pb2.ServiceInfo:
        info = common_pb2.ServiceInfo()
        info.CopyFrom(self.info)
        info.active_sequences = self.engine.active_sequences
        info.open_streams = self.open_streams
        return info
