"""The public Gateway servicer: validate, hand the request's samples to the router, stream events."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid

import grpc
import structlog

from gateway import metrics
from gateway.detokenizer import IncrementalDetokenizer
from gateway.request import ActiveRequest, Event, GenerationRequest, InvalidRequest
from gateway.router import NoBackend, QueueFull, Router
from gateway.validation import RequestValidator
from specdec.rpc import gateway_pb2, gateway_pb2_grpc


class AbortedRequest(Exception):
    """Ends a request with this gRPC status (a status name) and message."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """Answers UNAVAILABLE until `attach` hands it the router over the connected backends."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.validator: RequestValidator | None = None
        self.router: Router | None = None
        self.draining = False   # set on SIGTERM: running requests finish, new ones are refused
        self.log = structlog.get_logger(service="gateway")

    def attach(self, validator: RequestValidator, router: Router) -> None:
        self.validator, self.router = validator, router

    def _samples(self, req: GenerationRequest) -> list[ActiveRequest]:
        events: asyncio.Queue = asyncio.Queue()  # one stream for all samples
        samples = []
        for i in range(req.n):
            sampling = dataclasses.replace(req.sampling, seed=req.sample_seed(i))
            samples.append(ActiveRequest(
                req=req, seq_id=uuid.uuid4().hex, mode=req.spec.mode, events=events, sample_index=i,
                sampling=sampling, detok=IncrementalDetokenizer(self.tokenizer, req.prompt_ids, req.stop)))
        for r in samples[1:]:
            r.prefill_leader = samples[0].seq_id
        return samples

    async def Generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        status: str | None = "CANCELLED"   # unless it ends otherwise: the client went away or its deadline passed
        try:
            # aclosing: a cancelled call closes the inner generator at once, so its finally frees
            # the request's sequences everywhere now, not whenever it is collected.
            async with contextlib.aclosing(self._generate(request, context)) as stream:
                async for msg in stream:
                    yield msg
            status = "OK"
        except AbortedRequest as exc:
            # Counted before the abort: the client has the status as soon as abort sends it.
            metrics.REQUESTS.labels(exc.status).inc()
            status = None
            await context.abort(getattr(grpc.StatusCode, exc.status), exc.message)
        finally:
            if status is not None:
                metrics.REQUESTS.labels(status).inc()

    async def _generate(self, request: gateway_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        if self.router is None:
            raise AbortedRequest("UNAVAILABLE", "the gateway is still connecting to its backends")
        if self.draining:
            raise AbortedRequest("UNAVAILABLE", "the gateway is shutting down; retry (another replica serves it)")
        try:
            req = self.validator.validate(request)
        except InvalidRequest as exc:
            raise AbortedRequest("INVALID_ARGUMENT", str(exc)) from None
        samples = self._samples(req)
        log = self.log.bind(request_id=req.request_id, seq_id=samples[0].seq_id)
        try:
            self.router.submit(samples)
        except QueueFull as exc:
            raise AbortedRequest("RESOURCE_EXHAUSTED", str(exc)) from None
        except NoBackend as exc:
            raise AbortedRequest("UNAVAILABLE", str(exc)) from None
        log.info("request started", prompt_tokens=len(req.prompt_ids), mode=req.spec.mode.value, n=req.n,
                 max_new_tokens=req.max_new_tokens, verifier=samples[0].verifier, drafter=samples[0].drafter)
        metrics.PROMPT_TOKENS.inc(len(req.prompt_ids))
        started = time.perf_counter()
        first: dict[int, float] = {}
        open_samples = req.n
        try:
            while open_samples:
                ev = await samples[0].events.get()
                if ev.error is not None:
                    log.warning("request failed", status=ev.error[0], error=ev.error[1])
                    raise AbortedRequest(*ev.error)
                now = time.perf_counter()
                if ev.token_ids:
                    metrics.COMPLETION_TOKENS.inc(len(ev.token_ids))
                    if ev.sample_index not in first:
                        first[ev.sample_index] = now
                        metrics.TTFT.observe(now - started)
                text = ev.text if ev.text is not None else self._decode(samples[ev.sample_index], ev)
                msg = gateway_pb2.GenerateResponse(token_ids=ev.token_ids, text=text, sample_index=ev.sample_index)
                if ev.finish_reason is not None:
                    r = samples[ev.sample_index]
                    if r.generated > 1:
                        metrics.TPOT.observe((now - first[ev.sample_index]) / (r.generated - 1))
                    msg.final.CopyFrom(self._final(r, ev.finish_reason))
                    log.info("sample finished", sample=r.sample_index, reason=ev.finish_reason, tokens=r.generated,
                             mean_accepted_length=round(r.stats.mean_accepted_length, 3))
                    open_samples -= 1
                yield msg
        finally:
            for r in samples:
                if not r.finished:  # client cancel, deadline or a failed sibling: free it everywhere
                    self.router.cancel(r)

    @staticmethod
    def _decode(r: ActiveRequest, ev: Event) -> str:
        """The text of an event the scheduler left undecoded (a request without stop strings)."""
        text, _ = r.detok.add(ev.token_ids)
        return text + r.detok.finish() if ev.finish_reason is not None else text

    @staticmethod
    def _final(r: ActiveRequest, reason: str) -> gateway_pb2.FinalInfo:
        s = r.stats
        return gateway_pb2.FinalInfo(
            request_id=r.req.request_id, finish_reason=reason,
            prompt_tokens=len(r.req.prompt_ids), completion_tokens=r.generated,
            prompt_token_ids=r.req.prompt_ids, sample_index=r.sample_index, seed=r.sampling.seed,
            stats=gateway_pb2.SpeculationStats(
                steps=s.steps, drafted=s.drafted, accepted=s.accepted,
                mean_accepted_length=s.mean_accepted_length,
                overlap_hits=s.overlap_hits, overlap_misses=s.overlap_misses,
                mode="auto" if r.auto else r.mode.value, steps_by_mode=dict(s.steps_by_mode),
            ),
        )
