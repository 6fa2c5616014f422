"""gRPC servicer of the drafter: protobuf <-> engine dataclasses, engine work on its own thread."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc

from drafter_svc.engine import DrafterEngine
from drafter_svc.types import ChainShape, DraftItem, DrafterStep, DrafterStepResult, TreeShape
from specdec.rpc import common_pb2, drafter_pb2, drafter_pb2_grpc
from specdec.rpc.convert import error_to_proto, tree_to_proto


def item_from_proto(m: drafter_pb2.DraftItem) -> DraftItem:
    if m.WhichOneof("shape") == "tree":
        shape: ChainShape | TreeShape = TreeShape(m.tree.topk, m.tree.depth, m.tree.budget)
    else:
        shape = ChainShape(m.chain.k)
    return DraftItem(m.seq_id, m.committed_len, list(m.append_ids), list(m.assumed_ids), shape)


def result_to_proto(res: DrafterStepResult) -> drafter_pb2.DraftStepResponse:
    return drafter_pb2.DraftStepResponse(
        step=res.step,
        drafts=[
            drafter_pb2.Draft(seq_id=d.seq_id, committed_len=d.committed_len, assumed_len=d.assumed_len,
                              tree=tree_to_proto(d.tree))
            for d in res.drafts
        ],
        errors=[error_to_proto(e) for e in res.errors],
    )


class DrafterServicer(drafter_pb2_grpc.DrafterServicer):
    def __init__(self, engine: DrafterEngine, info: common_pb2.ServiceInfo, log,
                 executor: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.info = info
        self.log = log
        self.executor = executor  # the one thread that runs the engine (and its collectives)
        self.open_streams = 0

    async def Step(self, request_iterator, context: grpc.aio.ServicerContext):
        loop = asyncio.get_running_loop()
        owned: set[str] = set()  # sequences known on this stream: freed when it ends
        self.open_streams += 1
        try:
            async for msg in request_iterator:
                req = DrafterStep(msg.step, [item_from_proto(i) for i in msg.items], list(msg.close))
                owned -= set(req.close)
                try:
                    res = await loop.run_in_executor(self.executor, self.engine.step, req)
                except Exception as exc:
                    self.log.exception("drafter step failed", step=req.step)
                    await context.abort(grpc.StatusCode.INTERNAL, f"drafter step failed: {exc}")
                owned |= {d.seq_id for d in res.drafts}
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
