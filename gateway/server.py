"""Gateway process: tokenizer, replica routing over the drafters and verifiers, gRPC."""

from __future__ import annotations

import asyncio
import json

from transformers import AutoTokenizer

from gateway.admission import AdmissionPolicy
from gateway.auth import BearerTokenInterceptor, BearerTokens
from gateway.dialer import BackendDialer
from gateway.hold import HoldGate
from gateway.router import Router
from gateway.servicer import GatewayServicer
from gateway.validation import RequestValidator
from specdec.config import GatewayConfig
from specdec.log import configure_logging
from specdec.malloc_tuning import keep_freed_memory
from specdec.metrics import start_metrics
from specdec.rpc import gateway_pb2, gateway_pb2_grpc
from specdec.serving import ServingState, freeze_startup_objects, run, serve, wait_idle

BACKEND_WAIT_SECONDS = 600.0  # model loading can take minutes


def eos_ids(tokenizer, tokenizer_dir) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen = tokenizer_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def run_gateway(cfg: GatewayConfig) -> None:
    log = configure_logging("gateway")
    start_metrics(cfg.metrics_listen, log)
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.tokenizer_dir))
    servicer = GatewayServicer(tokenizer)
    tasks: set[asyncio.Task] = set()  # keeps the router's refresh task referenced

    async def on_start(state: ServingState) -> None:
        await state.set_serving(False)
        router = Router(cfg.verifier, cfg.drafter, cfg.max_queue, eos_ids(tokenizer, cfg.tokenizer_dir),
                        HoldGate(cfg.test_hold_dir), cfg.test_auto_cycle, BackendDialer(cfg.backend_tls),
                        cfg.backend_wait_seconds, AdmissionPolicy(cfg.admit_fraction, cfg.admit_max_wait_steps))
        log.info("waiting for backends", verifier=cfg.verifier, drafter=cfg.drafter)
        await router.wait_ready(BACKEND_WAIT_SECONDS)
        max_context, max_draft_tokens, max_sequences = router.limits()
        servicer.attach(RequestValidator(cfg, tokenizer, router.vocab_size, max_context, max_draft_tokens,
                                         max_sequences), router)
        serving = True

        async def report(can_serve: bool) -> None:
            """Health follows the backends: SERVING only while a verifier replica is healthy."""
            nonlocal serving
            if can_serve != serving:
                log.warning("serving again" if can_serve else "no healthy verifier; health is NOT_SERVING")
                serving = can_serve
                await state.set_serving(can_serve)

        tasks.add(asyncio.get_running_loop().create_task(router.run(cfg.resolve_interval, report)))
        freeze_startup_objects(log)
        if cfg.malloc_tuning:
            keep_freed_memory(log)
        await state.set_serving(True)
        log.info("backends ready", verifiers=len(router.verifiers.healthy()),
                 drafters=len(router.drafters.healthy()) if router.drafters else 0, max_context=max_context)
        print(f"gateway listening on {cfg.listen}", flush=True)

    async def drain() -> None:
        servicer.draining = True   # new requests: UNAVAILABLE; running ones finish
        router = servicer.router
        await wait_idle(lambda: router.load if router else 0, cfg.drain_seconds, log, "requests")

    interceptors = [BearerTokenInterceptor(BearerTokens(cfg.auth_tokens_file, cfg.auth_tokens))] if cfg.auth else []
    if not cfg.auth and not cfg.listen.startswith(("127.", "localhost", "[::1]")):
        log.warning("no bearer-token authentication: anyone who reaches this port can generate "
                    "(--auth-tokens-file or SPECDEC_AUTH_TOKENS turn it on)", listen=cfg.listen)
    run(serve(cfg.listen, lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s),
              gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name, log, on_start, drain,
              tls=cfg.tls, interceptors=interceptors, max_request_bytes=cfg.max_request_bytes))
