"""Start a drafter or verifier process: load the checkpoint, build the engine, serve gRPC."""

from __future__ import annotations

import torch

from specdec.config import EngineServiceConfig
from specdec.log import configure_logging
from specdec.model.loader import DTYPES, load_model
from specdec.rpc import common_pb2, drafter_pb2_grpc, verifier_pb2_grpc
from specdec.serving import run, serve


def run_engine_service(cfg: EngineServiceConfig) -> None:
    log = configure_logging(cfg.role)
    log.info("loading model", model=str(cfg.model_dir), device=cfg.device, dtype=cfg.dtype)
    model = load_model(cfg.model_dir, DTYPES[cfg.dtype], torch.device(cfg.device))
    info = common_pb2.ServiceInfo(
        role=cfg.role, model_name=cfg.model_dir.name, vocab_size=model.spec.vocab_size,
        max_sequences=cfg.max_sequences, max_draft_tokens=cfg.max_draft_tokens, device=cfg.device, dtype=cfg.dtype,
    )
    if cfg.role == "verifier":
        from verifier_svc.engine import VerifierEngine
        from verifier_svc.servicer import VerifierServicer

        engine = VerifierEngine(model, cfg.max_sequences, cfg.max_context, cfg.max_draft_tokens)
        info.max_context = engine.max_context
        servicer = VerifierServicer(engine, info, log)
        register = lambda server: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, server)  # noqa: E731
    else:
        from drafter_svc.engine import DrafterEngine
        from drafter_svc.servicer import DrafterServicer

        engine = DrafterEngine(model, cfg.max_sequences, cfg.max_context)
        info.max_context = engine.max_context
        servicer = DrafterServicer(engine, info, log)
        register = lambda server: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, server)  # noqa: E731
    run(serve(cfg.listen, register, log))
