"""The public Gateway servicer: validate, hand the request to the scheduler, stream its events."""

from __future__ import annotations

import uuid

import grpc
import structlog

from gateway.detokenizer import IncrementalDetokenizer
from gateway.request import ActiveRequest, InvalidRequest
from gateway.router import NoBackend, Router
from gateway.scheduler import QueueFull
from gateway.validation import RequestValidator
from specdec.rpc import gateway_pb2, gateway_pb2_grpc


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Answers UNAVAILABLE until `attach` hands it the router over the connected backends."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.validator: RequestValidator | None = None
        self.router: Router | None = None
        self.log = structlog.get_logger(service="gateway")

    def attach(self, validator: RequestValidator, router: Router) -> None:
        self.validator, self.router = validator, router

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.router is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the gateway is still connecting to its backends")
        try:
            req = self.validator.validate(request)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        r = ActiveRequest(req=req, seq_id=uuid.uuid4().hex, mode=req.spec.mode,
                          detok=IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.stop))
        log = self.log.bind(request_id=req.request_id, seq_id=r.seq_id)
        try:
            scheduler = self.router.submit(r)
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except NoBackend as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        log.info("request started", prompt_tokens=len(req.prompt_ids), mode=r.mode.value,
                 max_new_tokens=req.max_new_tokens, verifier=r.verifier, drafter=r.drafter)
        try:
            while True:
                ev = await r.events.get()
                if ev.error is not None:
                    log.warning("request failed", status=ev.error[0], error=ev.error[1])
                    await context.abort(getattr(grpc.StatusCode, ev.error[0]), ev.error[1])
                msg = gateway_pb2.GenerateResponse(token_ids=ev.token_ids, text=ev.text)
                if ev.finish_reason is not None:
                    msg.final.CopyFrom(self._final(r, ev.finish_reason))
                    log.info("request finished", reason=ev.finish_reason, tokens=r.generated,
                             mean_accepted_length=round(r.stats.mean_accepted_length, 3))
                    yield msg
                    return
                yield msg
        finally:
            if not r.finished:  # client cancel or deadline: free the sequence everywhere
                scheduler.cancel(r)

    @staticmethod
    def _final(r: ActiveRequest, reason: str) -> gateway_pb2.FinalInfo:
        s = r.stats
        return gateway_pb2.FinalInfo(
            request_id=r.req.request_id, finish_reason=reason,
            prompt_tokens=len(r.req.prompt_ids), completion_tokens=r.generated,
            prompt_token_ids=r.req.prompt_ids,
            stats=gateway_pb2.SpeculationStats(
                steps=s.steps, drafted=s.drafted, accepted=s.accepted,
                mean_accepted_length=s.mean_accepted_length,
                overlap_hits=s.overlap_hits, overlap_misses=s.overlap_misses, mode=r.mode.value,
            ),
        )
