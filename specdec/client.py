"""`specdec generate`: call the gateway, stream the text as it comes, optionally end with JSON."""

from __future__ import annotations

import argparse
import json
import sys

import grpc

from specdec.env import env
from specdec.rpc import gateway_pb2, gateway_pb2_grpc
from specdec.security import TlsConfig, add_client_tls_arguments, blocking_channel, client_tls_from_args

MODES = {"default": gateway_pb2.SPEC_MODE_UNSPECIFIED, "auto": gateway_pb2.SPEC_MODE_AUTO,
         "chain": gateway_pb2.SPEC_MODE_CHAIN, "tree": gateway_pb2.SPEC_MODE_TREE, "off": gateway_pb2.SPEC_MODE_OFF}


def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="text prompt (tokenizer's special-token rules apply)")
    p.add_argument("--gateway", default=env("GATEWAY_ADDR", "127.0.0.1:50051"))
    p.add_argument("--token", default=env("TOKEN"),
                   help="bearer token for a gateway that requires one (env SPECDEC_TOKEN; prefer the env var: "
                        "a flag shows in the process list)")
    add_client_tls_arguments(p)
    p.add_argument("--token-ids", default=None, help="comma-separated prompt token ids, used exactly as given")
    p.add_argument("--mode", choices=list(MODES), default="default",
                   help="speculation mode (default: the gateway's --default-mode, auto unless configured)")
    p.add_argument("--k", type=int, default=0, help="chain draft length (0 = server default)")
    p.add_argument("--no-overlap", action="store_true", help="chain: do not pre-draft during verification")
    p.add_argument("--topk", type=int, default=0)
    p.add_argument("--depth", type=int, default=0)
    p.add_argument("--budget", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=0, help="0 = server default")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template to a text prompt")
    p.add_argument("--request-id", default="")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None, help="same seed and settings, same output")
    p.add_argument("--n", type=int, default=1, help="independent samples (sharing the prompt's prefill)")
    p.add_argument("--json", action="store_true",
                   help="end stdout with one JSON object of ids, text and stats (one line per sample)")


def build_request(a: argparse.Namespace) -> gateway_pb2.GenerateRequest:
    req = gateway_pb2.GenerateRequest(
        request_id=a.request_id, max_new_tokens=a.max_new_tokens, stop=a.stop, apply_chat_template=a.chat,
        speculation=gateway_pb2.SpeculationConfig(
            mode=MODES[a.mode], k=a.k, overlap=not a.no_overlap, topk=a.topk, depth=a.depth, budget=a.budget),
    )
    if a.ignore_eos:
        req.stop_at_eos = False
    req.sampling.temperature, req.sampling.top_p, req.sampling.top_k, req.sampling.n = (
        a.temperature, a.top_p, a.top_k, a.n)
    if a.seed is not None:
        req.sampling.seed = a.seed
    if a.token_ids is not None:
        req.token_ids.ids.extend(int(t) for t in a.token_ids.split(",") if t.strip())
    else:
        req.text = a.prompt or ""
    return req


def generate(a: argparse.Namespace) -> int:
    """Streams the text of one sample as it comes; with n > 1 prints each sample's text at its end."""
    ids: dict[int, list[int]] = {}
    text: dict[int, list[str]] = {}
    finals = {}
    metadata = (("authorization", f"Bearer {a.token}"),) if a.token else None
    with blocking_channel(a.gateway, client_tls_from_args(a), a.tls_server_name) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        try:
            for msg in stub.Generate(build_request(a), timeout=a.timeout, metadata=metadata):
                i = msg.sample_index
                ids.setdefault(i, []).extend(msg.token_ids)
                text.setdefault(i, []).append(msg.text)
                if a.n == 1:
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
                if msg.HasField("final"):
                    finals[i] = msg.final
                    if a.n > 1:
                        print(f"[sample {i}] {''.join(text[i])}", flush=True)
        except grpc.RpcError as exc:
            print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if a.n == 1:
        sys.stdout.write("\n")
    if a.json:
        for i in sorted(finals):
            print(json.dumps(summary(finals[i], ids.get(i, []), "".join(text.get(i, [])))))
    return 0


def summary(final, ids: list[int], text: str) -> dict:
    s = final.stats
    return {
        "request_id": final.request_id,
        "sample_index": final.sample_index,
        "seed": final.seed,
        "prompt_token_ids": list(final.prompt_token_ids),
        "output_token_ids": ids,
        "text": text,
        "finish_reason": final.finish_reason,
        "stats": {
            "mode": s.mode, "steps": s.steps, "drafted": s.drafted, "accepted": s.accepted,
            "mean_accepted_length": s.mean_accepted_length,
            "overlap_hits": s.overlap_hits, "overlap_misses": s.overlap_misses,
            "steps_by_mode": dict(s.steps_by_mode),
        },
    }


def check_health(address: str, timeout: float, tls: TlsConfig | None = None, server_name: str | None = None) -> int:
    """0 when the standard grpc.health.v1 Check answers SERVING, else 1 (with the reason on stderr)."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with blocking_channel(address, tls, server_name) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            print(f"{address}: {exc.code().name}", file=sys.stderr)
            return 1
    serving = resp.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        print(f"{address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)}", file=sys.stderr)
    return 0 if serving else 1
