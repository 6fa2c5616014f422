"""The part of the drafter and verifier servicers that is the same: a bidirectional step stream
whose steps run on the engine's single worker thread, and whose sequences are freed when the
stream ends (a gateway that goes away leaves nothing behind)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc

from specdec.errors import STEP_FAILED_KEY
from specdec.metrics import ENGINE_STREAMS, EngineMetrics
from specdec.rpc import common_pb2


class StepStreamServicer:
    def __init__(self, engine, info: common_pb2.ServiceInfo, log, executor: ThreadPoolExecutor) -> None:
        self.engine = engine
        self.info = info
        self.log = log
        self.executor = executor  # the one thread that runs the engine (and its collectives)
        self.open_streams = 0
        self.metrics = EngineMetrics(info.role, engine)

    # Subclasses convert between protobuf and the engine's dataclasses.
    def step_from_proto(self, msg):
        raise NotImplementedError

    def result_to_proto(self, res):
        raise NotImplementedError

    def held_after(self, req, res) -> set[str]:
        """Sequence ids the engine holds for this stream after `req` ran."""
        raise NotImplementedError

    async def Step(self, request_iterator, context: grpc.aio.ServicerContext):
        owned: set[str] = set()
        in_flight = None   # (request, executor future) of the step running now
        self.open_streams += 1
        ENGINE_STREAMS.labels(self.info.role).set(self.open_streams)
        try:
            async for msg in request_iterator:
                t0 = time.perf_counter()
                req = self.step_from_proto(msg)
                owned -= set(req.close)
                decoded = time.perf_counter()
                in_flight = (req, self.executor.submit(self._timed_step, req))
                try:
                    res, seconds = await asyncio.wrap_future(in_flight[1])
                except Exception as exc:  # a bug, not bad input: end this stream loudly
                    self.log.exception("step failed", step=req.step)
                    await context.abort(grpc.StatusCode.INTERNAL, f"{self.info.role} step failed: {exc}",
                                        trailing_metadata=((STEP_FAILED_KEY, "1"),))
                in_flight = None
                returned = time.perf_counter()
                owned |= self.held_after(req, res)
                self.metrics.after_step(seconds)
                msg = self.result_to_proto(res)
                msg.engine_seconds = seconds
                # Where a step's time went on this side of the wire, one line a step at debug level:
                # decoding the request, the engine thread (queue included), encoding the result.
                self.log.debug("engine step", step=req.step, decode_ms=round((decoded - t0) * 1e3, 3),
                               engine_ms=round(seconds * 1e3, 3), thread_ms=round((returned - decoded) * 1e3, 3),
                               encode_ms=round((time.perf_counter() - returned) * 1e3, 3))
                yield msg
        finally:
            self.open_streams -= 1
            ENGINE_STREAMS.labels(self.info.role).set(self.open_streams)
            if owned or in_flight:
                # Queued behind any step still running (one engine thread), and not awaited: a
                # stream cancelled mid-step must still free what that step opened, and a second
                # cancellation of this handler must not drop the freeing.
                self.executor.submit(self._free, owned, in_flight)

    def _free(self, owned: set[str], in_flight) -> None:
        """On the engine thread: close the stream's sequences, with those a step cut off by the
        stream's end had opened (that step has finished: it ran before this on the same thread)."""
        if in_flight is not None:
            req, step = in_flight
            if not step.cancelled() and step.exception() is None:
                owned = owned | self.held_after(req, step.result()[0])
        if owned:
            self.log.info("stream ended; freeing its sequences", count=len(owned))
            self.engine.close(sorted(owned))
            self.metrics.refresh()

    def _timed_step(self, req):
        t0 = time.perf_counter()
        res = self.engine.step(req)
        return res, time.perf_counter() - t0

    async def GetInfo(self, request, context) -> common_pb2.ServiceInfo:
        info = common_pb2.ServiceInfo()
        info.CopyFrom(self.info)
        info.active_sequences = len(self.engine.table)
        info.sequences_opened = self.engine.table.opened
        info.prefill_tokens_computed = getattr(self.engine, "prefill_tokens_computed", 0)  # drafters keep none
        info.open_streams = self.open_streams
        return info
