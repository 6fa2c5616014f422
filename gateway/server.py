"""Gateway process: tokenizer, connections to the drafter and verifier, the scheduler, gRPC."""

from __future__ import annotations

import asyncio
import json

from transformers import AutoTokenizer

from gateway.backends import StepStream
from gateway.scheduler import Scheduler
from gateway.servicer import GatewayServicer
from gateway.validation import RequestValidator
from specdec.config import GatewayConfig
from specdec.log import configure_logging
from specdec.rpc import gateway_pb2_grpc
from specdec.serving import ServingState, run, serve

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
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.tokenizer_dir))
    servicer = GatewayServicer(tokenizer)
    tasks: set[asyncio.Task] = set()  # keeps the scheduler task referenced

    async def on_start(state: ServingState) -> None:
        await state.set_serving(False)
        # grpc.aio channels belong to the running event loop: create them here.
        verifier = StepStream("verifier", cfg.verifier)
        drafter = StepStream("drafter", cfg.drafter) if cfg.drafter else None
        log.info("waiting for backends", verifier=cfg.verifier, drafter=cfg.drafter)
        v_info = await verifier.info(timeout=BACKEND_WAIT_SECONDS, wait=True)
        max_sequences, max_context = v_info.max_sequences, v_info.max_context
        if drafter is not None:
            d_info = await drafter.info(timeout=BACKEND_WAIT_SECONDS, wait=True)
            if d_info.vocab_size != v_info.vocab_size:
                raise SystemExit(
                    f"draft vocabulary ({d_info.vocab_size}) differs from the target's ({v_info.vocab_size}): "
                    "the draft model must share the target's tokenizer")
            max_sequences = min(max_sequences, d_info.max_sequences)
            max_context = min(max_context, d_info.max_context)
        scheduler = Scheduler(verifier, drafter, max_sequences, cfg.max_queue, eos_ids(tokenizer, cfg.tokenizer_dir))
        validator = RequestValidator(cfg, tokenizer, v_info.vocab_size, max_context, v_info.max_draft_tokens)
        servicer.attach(validator, scheduler)
        tasks.add(asyncio.get_running_loop().create_task(scheduler.run()))
        await state.set_serving(True)
        log.info("backends ready", max_sequences=max_sequences, max_context=max_context)
        print(f"gateway listening on {cfg.listen}", flush=True)

    run(serve(cfg.listen, lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s), log, on_start))

