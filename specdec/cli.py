"""`specdec` console script: serve (all three services), one service, or a streaming client."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from specdec.config import (
    EngineServiceConfig,
    GatewayConfig,
    add_auth_arguments,
    add_device_arguments,
    resolve_device,
)
from specdec.env import env, env_flag
from specdec.security import add_client_tls_arguments, add_server_tls_arguments


def default_models(target: str | None, draft: str | None) -> tuple[Path, Path]:
    """Checkpoint dirs: as given, else the embedded SmolLM2 target and its derived drafter."""
    if target and draft:
        return Path(target), Path(draft)
    if target and not draft:
        raise SystemExit("--draft is required with --target (a draft model sharing the target's tokenizer)")
    from specdec.embedded_model import ensure_embedded_models

    emb_target, emb_draft = ensure_embedded_models()
    return Path(target or emb_target), Path(draft or emb_draft)


def embedded_head_dir() -> Path:
    from specdec.embedded_head import embedded_head

    return embedded_head()


def engine_config(args: argparse.Namespace) -> EngineServiceConfig:
    """A drafter or verifier; without --model, the embedded defaults: the SmolLM2 target, drafted
    for by the embedded EAGLE-3 head (the verifier then sends that head's layers, projected by its fc)."""
    role = args.command
    if args.model_dir:
        return EngineServiceConfig.from_args(args, role, Path(args.model_dir))
    target = default_models(None, None)[0]
    cfg = EngineServiceConfig.from_args(args, role, target)
    # The embedded pair's rows travel projected by the head's fc unless a flag says otherwise:
    # --no-projected-hidden-states (drafter), --aux-hidden-layers or --project-hidden-states (verifier).
    if role == "drafter" and cfg.eagle3_head is None and cfg.controlled is None:
        return replace(cfg, eagle3_head=embedded_head_dir(),
                       projected_hidden_states=args.projected_hidden_states is not False)
    if role == "verifier" and not cfg.aux_hidden_layers and cfg.project_hidden_states is None:
        return replace(cfg, project_hidden_states=embedded_head_dir())
    return cfg


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="specdec", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start verifier, drafter and gateway as three processes")
    s.add_argument("--target", default=env("TARGET_MODEL"), help="target checkpoint dir (default: embedded SmolLM2)")
    s.add_argument("--draft", default=env("DRAFT_MODEL"), help="draft checkpoint dir (same tokenizer)")
    s.add_argument("--listen", default=env("GATEWAY_LISTEN", "127.0.0.1:50051"))
    add_device_arguments(s)
    s.add_argument("--no-drafter", action="store_true", help="run mode off only (no drafter process)")
    s.add_argument("--verifier-gpus", default=None, help="CUDA_VISIBLE_DEVICES of the verifier, e.g. 1")
    s.add_argument("--drafter-gpus", default=None, help="CUDA_VISIBLE_DEVICES of the drafter, e.g. 0")
    s.add_argument("--tp", type=int, default=int(env("VERIFIER_TP", "1")), help="tensor-parallel ranks of the verifier")
    s.add_argument("--max-sequences", type=int, default=int(env("MAX_SEQUENCES", "32")))
    s.add_argument("--max-context", type=int, default=int(env("MAX_CONTEXT", "2048")))
    s.add_argument("--eagle3-head", default=env("EAGLE3_HEAD"),
                   help="draft with this EAGLE-3 head (published layout) instead of --draft; the verifier then "
                        "sends the head's hidden-state layers with its verdicts (default with no --target and "
                        "no --draft: the embedded head trained for SmolLM2)")
    s.add_argument("--project-hidden-states", action=argparse.BooleanOptionalAction,
                   default=env_flag("SERVE_PROJECT_HIDDEN_STATES") is not False,
                   help="with an EAGLE-3 head: the verifier applies the head's fc to the hidden states it sends, "
                        "so they travel at the head's width, not three layers' (default on; env "
                        "SPECDEC_SERVE_PROJECT_HIDDEN_STATES=0 turns it off)")
    s.add_argument("--max-restarts", type=int, default=int(env("MAX_RESTARTS", "5")),
                   help="a child that dies is restarted; more than this many restarts within --restart-window "
                        "seconds is a crash loop and stops serve")
    s.add_argument("--restart-window", type=float, default=float(env("RESTART_WINDOW", "60")))
    add_server_tls_arguments(s)
    add_auth_arguments(s)
    s.add_argument("--batch-invariant", action="store_true", default=env("BATCH_INVARIANT", "0") not in ("0", "false", "no"),
                   help="verifier with batch-invariant kernels: every mode bit-identical to mode off in bf16 (slower)")

    for role in ("verifier", "drafter"):
        r = sub.add_parser(role, help=f"run the {role} service alone")
        EngineServiceConfig.add_arguments(r, role)

    g = sub.add_parser("gateway", help="run the gateway service alone")
    GatewayConfig.add_arguments(g)

    c = sub.add_parser("generate", help="stream a completion from a running gateway")
    from specdec.client import add_generate_arguments

    add_generate_arguments(c)

    t = sub.add_parser("train-drafter", help="train an EAGLE-3 draft head for a target (self-distillation)")
    from specdec.train.cli import add_arguments as add_train_arguments

    add_train_arguments(t)

    h = sub.add_parser("health", help="exit 0 if a service's gRPC health check says SERVING (container healthcheck)")
    h.add_argument("--address", default=env("HEALTH_ADDR", "127.0.0.1:50051"))
    h.add_argument("--timeout", type=float, default=3.0)
    add_client_tls_arguments(h)

    args = p.parse_args(argv)
    if args.command == "serve":
        from specdec.launcher import serve_all

        target, draft = default_models(args.target, args.draft)
        head = args.eagle3_head or (None if args.target or args.draft else embedded_head_dir())
        sys.exit(serve_all(args, target, draft, Path(head) if head else None))
    elif args.command in ("verifier", "drafter"):
        from specdec.engine_service import run_engine_service

        args.device, args.dtype = resolve_device(args.device, args.dtype)
        run_engine_service(engine_config(args))
    elif args.command == "gateway":
        from gateway.server import run_gateway

        tok = args.tokenizer or args.target or str(default_models(None, None)[0])
        run_gateway(GatewayConfig.from_args(args, Path(tok)))
    elif args.command == "train-drafter":
        from specdec.train.cli import config_from_args, print_report
        from specdec.train.trainer import train_drafter

        cfg = config_from_args(args, Path(args.target) if args.target else default_models(None, None)[0])
        print_report(train_drafter(cfg), cfg.out)
    elif args.command == "health":
        from specdec.client import check_health
        from specdec.security import client_tls_from_args

        sys.exit(check_health(args.address, args.timeout, client_tls_from_args(args), args.tls_server_name))
    elif args.command == "generate":
        from specdec.client import generate

        sys.exit(generate(args))


if __name__ == "__main__":
    main()
