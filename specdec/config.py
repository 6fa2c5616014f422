"""Typed service configuration, read once from flags with SPECDEC_* environment defaults."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from specdec.env import env, env_flag
from specdec.security import (
    TlsConfig,
    add_backend_tls_arguments,
    add_server_tls_arguments,
    backend_tls_from_args,
    server_tls_from_args,
)


REFERENCE_FORMAT = "specdec-controlled-acceptance/1"


@dataclass(frozen=True)
class ControlledAcceptance:
    """Benchmarks only (drafter_svc/controlled.py): the drafter still runs its model, then proposes
    the target's own continuation of each prompt (`references`: prompt ids -> mode-off output ids)
    so that the target accepts each draft position with probability `acceptance`, drawn from `seed`."""

    references: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]
    acceptance: float
    seed: int = 0

    @classmethod
    def from_file(cls, path: str | Path, acceptance: float, seed: int = 0) -> ControlledAcceptance:
        if not 0.0 <= acceptance <= 1.0:
            raise SystemExit(f"--acceptance {acceptance} must be in [0, 1]")
        try:
            data = json.loads(Path(path).read_text())
            if data.get("format") != REFERENCE_FORMAT:
                raise ValueError(f"format is {data.get('format')!r}, expected {REFERENCE_FORMAT!r}")
            refs = tuple((tuple(map(int, e["prompt_ids"])), tuple(map(int, e["output_ids"])))
                         for e in data["references"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"--controlled-acceptance {path}: not a reference file ({exc})") from exc
        return cls(refs, acceptance, seed)

    @staticmethod
    def write_references(path: str | Path, pairs: list[tuple[list[int], list[int]]]) -> None:
        """The file `from_file` reads: each prompt with the target's mode-off continuation of it."""
        entries = [{"prompt_ids": list(p), "output_ids": list(o)} for p, o in pairs]
        Path(path).write_text(json.dumps({"format": REFERENCE_FORMAT, "references": entries}))


@dataclass(frozen=True)
class EngineServiceConfig:
    """A drafter or verifier process."""

    role: str                 # "drafter" | "verifier"
    model_dir: Path
    listen: str
    device: str
    dtype: str
    max_sequences: int
    max_context: int
    max_draft_tokens: int
    tp: int
    cuda_graphs: bool = True
    controlled: ControlledAcceptance | None = None  # drafter only: benchmarks' known acceptance
    batch_invariant: bool = False  # batch-invariant matmuls and attention (bit-identical modes)
    aux_hidden_layers: tuple[int, ...] = ()  # verifier: layer inputs whose hidden states verdicts carry
    eagle3_head: Path | None = None  # drafter: an EAGLE-3 head (--model is then the target checkpoint)
    cost_profile: bool = True        # time engine steps at start-up for the gateway's --mode auto
    metrics_listen: str = ""         # Prometheus /metrics address (empty: none)
    drain_seconds: float = 25.0      # on SIGTERM: how long in-flight sequences may take to finish
    tls: TlsConfig = TlsConfig()     # plaintext unless --tls-cert/--tls-key
    prefill_chunk: int = 512         # verifier: prompt tokens prefilled per step over all sequences (0: whole)
    cpu_threads: int = 0             # on cpu: torch threads over all TP ranks (0: every available core)
    hedge_predrafts: bool = False    # drafter (EAGLE-3): overlap pre-drafts also for each earlier rejection
    fold_prefill: bool = False       # verifier: prompt chunks ride in the verify forward as extra rows
    hidden_states_fp8: bool = False  # verifier: verdicts carry hidden states packed to float8 (cuda default)
    project_hidden_states: Path | None = None  # verifier: an EAGLE-3 head whose fc projects the rows sent
    projected_hidden_states: bool = False      # drafter (EAGLE-3): the verifier applies the head's fc
    malloc_tuning: bool = True       # once serving, large freed blocks stay for reuse (specdec/malloc_tuning.py)

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser, role: str) -> None:
        key = role.upper()
        p.add_argument("--model", dest="model_dir", default=env(f"{key}_MODEL"),
                       help=f"checkpoint directory (env SPECDEC_{key}_MODEL; default: the embedded model)")
        p.add_argument("--listen", default=env(f"{key}_LISTEN", "127.0.0.1:50061" if role == "verifier" else "127.0.0.1:50062"))
        add_device_arguments(p)
        p.add_argument("--max-sequences", type=int, default=int(env("MAX_SEQUENCES", "32")),
                       help="KV slots: sequences held at once")
        p.add_argument("--max-context", type=int, default=int(env("MAX_CONTEXT", "2048")),
                       help="longest prompt + output per sequence (capped by the model)")
        p.add_argument("--max-draft-tokens", type=int, default=int(env("MAX_DRAFT_TOKENS", "64")),
                       help="most draft tokens verified per sequence and step")
        p.add_argument("--tp", type=int, default=int(env(f"{key}_TP", env("TP", "1"))),
                       help=f"tensor-parallel ranks (env SPECDEC_{key}_TP or SPECDEC_TP): GPUs on cuda, processes on cpu")
        p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                       default=env("CUDA_GRAPHS", "1") not in ("0", "false", "no"),
                       help="capture the repeating step forwards as CUDA graphs at start-up (cuda; every "
                            "verifier rank, a drafter at --tp 1 only; env SPECDEC_CUDA_GRAPHS=0 turns it off)")
        p.add_argument("--cpu-threads", type=int, default=int(env(f"{key}_CPU_THREADS", env("CPU_THREADS", "0"))),
                       help=f"on cpu: threads for the engine's tensor work, shared by its --tp ranks (env "
                            f"SPECDEC_{key}_CPU_THREADS or SPECDEC_CPU_THREADS; default 0: every core this process "
                            "may use; `specdec serve` gives its verifier and drafter shares of the cores)")
        add_metrics_argument(p, key)
        add_drain_argument(p)
        add_malloc_argument(p)
        add_server_tls_arguments(p)
        p.add_argument("--cost-profile", action=argparse.BooleanOptionalAction,
                       default=env("COST_PROFILE", "1") not in ("0", "false", "no"),
                       help="time engine steps per batch size and shape at start-up and report them, for the "
                            "gateway's --mode auto (env SPECDEC_COST_PROFILE=0 turns it off; auto then falls "
                            "back to the default chain)")
        if role == "verifier":
            p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction,
                           default=env("BATCH_INVARIANT", "0") not in ("0", "false", "no"),
                           help="matmuls and attention with one tile shape and reduction order whatever the "
                                "batch, so every mode gives bit-identical logits and tokens in bf16; slower, "
                                "see BENCHMARKS.md (env SPECDEC_BATCH_INVARIANT=1)")
            p.add_argument("--prefill-chunk", type=int, default=int(env("PREFILL_CHUNK", "512")),
                           help="prompt tokens prefilled per step over all new sequences, so a long prompt delays "
                                "running streams by one chunk's forward per step, not by its whole prefill; "
                                "0: whole prompts at once (env SPECDEC_PREFILL_CHUNK)")
            p.add_argument("--fold-prefill", action=argparse.BooleanOptionalAction, default=env_flag("FOLD_PREFILL"),
                           help="prompt chunks ride in the step's verify forward as extra rows (one pass over the "
                                "weights, not two; graphs are captured for twice --max-sequences rows). Default: "
                                "on cuda, where it saves a prompt's second pass over the weights; off on cpu "
                                "(env SPECDEC_FOLD_PREFILL=1/0)")
            p.add_argument("--aux-hidden-layers", default=env("AUX_HIDDEN_LAYERS", ""),
                           help="comma-separated target layers (0..num_layers) whose input hidden states every "
                                "verdict carries for the tokens it commits, for an EAGLE-3 drafter; e.g. 2,16,29 "
                                "(env SPECDEC_AUX_HIDDEN_LAYERS; default none)")
            p.add_argument("--hidden-states-fp8", action=argparse.BooleanOptionalAction,
                           default=env_flag("HIDDEN_STATES_FP8"),
                           help="verdicts carry the hidden states packed to float8 with a scale per row, half "
                                "the bytes of bf16 on every hop to the drafter (drafts only: output unchanged). "
                                "Default: on cuda, where it is packed on the device; off on cpu "
                                "(env SPECDEC_HIDDEN_STATES_FP8=1/0)")
            p.add_argument("--project-hidden-states", metavar="HEAD", default=env("PROJECT_HIDDEN_STATES"),
                           help="apply this EAGLE-3 head's fc to the hidden states before they leave: rows of the "
                                "head's width instead of the aux layers' concatenation (a third of the bytes for "
                                "three layers); the drafter then runs with --projected-hidden-states. Implies "
                                "--aux-hidden-layers of the head (env SPECDEC_PROJECT_HIDDEN_STATES)")
        if role == "drafter":
            p.add_argument("--projected-hidden-states", action=argparse.BooleanOptionalAction,
                           default=env_flag("PROJECTED_HIDDEN_STATES"),
                           help="EAGLE-3 head: the verifier applies the head's fc (--project-hidden-states HEAD), "
                                "so the rows arrive at the head's width (env SPECDEC_PROJECTED_HIDDEN_STATES=1)")
            p.add_argument("--eagle3-head", metavar="DIR", default=env("EAGLE3_HEAD"),
                           help="draft with this EAGLE-3 head (the published checkpoint layout) instead of a draft "
                                "model; --model is then the TARGET checkpoint (for its embeddings), and the verifier "
                                "must run with --aux-hidden-layers set to the head's layers (env SPECDEC_EAGLE3_HEAD)")
            p.add_argument("--hedge-predrafts", action=argparse.BooleanOptionalAction,
                           default=env("HEDGE_PREDRAFTS", "0") not in ("0", "false", "no"),
                           help="EAGLE-3 head: an overlap pre-draft of a greedy chain also drafts, for each draft "
                                "position, after the head's best other token there (its guess of the verifier's "
                                "correction), so a step after a rejection finds its draft ready too; costs draft "
                                "work beside each verify: for a drafter on an accelerator of its own "
                                "(env SPECDEC_HEDGE_PREDRAFTS=1)")
            g = p.add_argument_group("controlled acceptance (benchmarks only)")
            g.add_argument("--controlled-acceptance", metavar="FILE", default=env("CONTROLLED_ACCEPTANCE"),
                           help="reference file (prompt ids -> the target's mode-off output ids, written by "
                                "benchmarks/): drafts propose the reference token with probability --acceptance")
            acceptance = env("ACCEPTANCE")
            g.add_argument("--acceptance", type=float, default=float(acceptance) if acceptance else None,
                           help="probability in [0, 1] that a draft position proposes the target's token")
            g.add_argument("--acceptance-seed", type=int, default=int(env("ACCEPTANCE_SEED", "0")),
                           help="seed of the per-position keep draws")

    @classmethod
    def from_args(cls, a: argparse.Namespace, role: str, model_dir: Path) -> EngineServiceConfig:
        if a.tp < 1:
            raise SystemExit("--tp must be at least 1")
        if a.cpu_threads < 0:
            raise SystemExit("--cpu-threads must be >= 0 (0: every available core)")
        if getattr(a, "prefill_chunk", 0) < 0:
            raise SystemExit("--prefill-chunk must be >= 0 (0: whole prompts)")
        controlled = None
        reference_file, acceptance = getattr(a, "controlled_acceptance", None), getattr(a, "acceptance", None)
        if reference_file:
            if acceptance is None:
                raise SystemExit("--controlled-acceptance needs --acceptance A (0..1)")
            controlled = ControlledAcceptance.from_file(reference_file, acceptance, a.acceptance_seed)
        elif acceptance is not None:
            raise SystemExit("--acceptance needs --controlled-acceptance FILE")
        return cls(role, model_dir, a.listen, a.device, a.dtype, a.max_sequences, a.max_context,
                   a.max_draft_tokens, a.tp, a.cuda_graphs, controlled, getattr(a, "batch_invariant", False),
                   parse_layers(getattr(a, "aux_hidden_layers", "")),
                   Path(a.eagle3_head) if getattr(a, "eagle3_head", None) else None, a.cost_profile, a.metrics_listen, a.drain_seconds,
                   server_tls_from_args(a), getattr(a, "prefill_chunk", 0), a.cpu_threads,
                   getattr(a, "hedge_predrafts", False), on_cuda_unless_set(a, "fold_prefill"),
                   on_cuda_unless_set(a, "hidden_states_fp8"),
                   Path(a.project_hidden_states) if getattr(a, "project_hidden_states", None) else None,
                   bool(getattr(a, "projected_hidden_states", False)), a.malloc_tuning)


def on_cuda_unless_set(a: argparse.Namespace, flag: str) -> bool:
    """A verifier flag whose default (None: not given) is on where it runs on cuda; False for a
    role without the flag."""
    if not hasattr(a, flag):
        return False
    value = getattr(a, flag)
    return a.device == "cuda" if value is None else value


def parse_layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.replace(" ", "").split(",") if x)
    except ValueError:
        raise SystemExit(f"--aux-hidden-layers takes comma-separated layer numbers, not {text!r}") from None


def add_drain_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drain-seconds", type=float, default=float(env("DRAIN_SECONDS", "25")),
                   help="on SIGTERM/SIGINT: stop admitting, give in-flight work this long to finish, then exit "
                        "(env SPECDEC_DRAIN_SECONDS; keep it below compose's stop_grace_period, 30 s)")


def add_malloc_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--malloc-tuning", action=argparse.BooleanOptionalAction,
                   default=env_flag("MALLOC_TUNING") is not False,
                   help="once serving, glibc keeps large freed blocks for reuse instead of mapping them afresh each "
                        "step (a wave's hidden-state rows cost several times their copies otherwise); a process then "
                        "keeps up to 1 GiB of freed memory (env SPECDEC_MALLOC_TUNING; default on)")


def add_auth_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--auth-tokens-file", default=env("AUTH_TOKENS_FILE"), metavar="FILE",
                   help="require 'authorization: Bearer <token>' on every call but health checks; tokens one per "
                        "line, re-read when the file changes (env SPECDEC_AUTH_TOKENS_FILE; SPECDEC_AUTH_TOKENS takes "
                        "comma-separated tokens too; default: no authentication)")


def add_metrics_argument(p: argparse.ArgumentParser, key: str) -> None:
    p.add_argument("--metrics-listen", default=env(f"{key}_METRICS_LISTEN", env("METRICS_LISTEN", "")),
                   help=f"serve Prometheus metrics at HOST:PORT/metrics (env SPECDEC_{key}_METRICS_LISTEN or "
                        "SPECDEC_METRICS_LISTEN; default: none)")


def add_device_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=["cpu", "cuda"], default=env("DEVICE"), help="default: cuda if available")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"], default=env("DTYPE"),
                   help="default: bfloat16 on cuda, float32 on cpu")


def resolve_device(device: str | None, dtype: str | None) -> tuple[str, str]:
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was asked for but torch sees no CUDA device")
    return device, dtype or ("bfloat16" if device == "cuda" else "float32")


@dataclass(frozen=True)
class GatewayConfig:
    listen: str
    verifier: str
    drafter: str | None
    tokenizer_dir: Path
    max_queue: int
    default_max_new_tokens: int
    default_k: int
    default_topk: int
    default_depth: int
    default_budget: int
    resolve_interval: float
    test_hold_dir: Path | None = None
    default_mode: str = "auto"      # for requests that leave the mode unspecified
    max_n: int = 64                 # most samples one request may ask for
    metrics_listen: str = ""        # Prometheus /metrics address (empty: none)
    drain_seconds: float = 25.0     # on SIGTERM: how long in-flight requests may take to finish
    test_auto_cycle: bool = False   # tests only: auto cycles through its choices step by step
    tls: TlsConfig = TlsConfig()           # the public port: plaintext unless --tls-cert/--tls-key
    backend_tls: TlsConfig = TlsConfig()   # links to verifiers and drafters: plaintext unless --backend-tls-ca
    auth_tokens_file: Path | None = None   # bearer tokens, one per line (re-read when it changes)
    auth_tokens: tuple[str, ...] = ()      # bearer tokens from SPECDEC_AUTH_TOKENS
    max_request_bytes: int = 4 * 1024 * 1024  # larger requests: RESOURCE_EXHAUSTED
    backend_wait_seconds: float = 10.0     # how long requests wait for a healthy verifier before UNAVAILABLE
    admit_fraction: float = 0.125          # waiting prompts join a running batch once they are this share of it
    admit_max_wait_steps: int = 4          # ... or once the oldest has waited this many steps (0: at once)
    malloc_tuning: bool = True             # once serving, large freed blocks stay for reuse (specdec/malloc_tuning.py)

    @property
    def auth(self) -> bool:
        return self.auth_tokens_file is not None or bool(self.auth_tokens)

    @staticmethod
    def add_arguments(p: argparse.ArgumentParser) -> None:
        p.add_argument("--listen", default=env("GATEWAY_LISTEN", "127.0.0.1:50051"))
        p.add_argument("--verifier", default=env("VERIFIER_ADDR", "127.0.0.1:50061"),
                       help="verifier replicas: HOST:PORT[,HOST:PORT...]; a name resolving to several IPs "
                            "counts as several replicas")
        p.add_argument("--drafter", default=env("DRAFTER_ADDR", "127.0.0.1:50062"),
                       help="drafter replicas, as --verifier; 'none' serves mode off only")
        p.add_argument("--resolve-interval", type=float, default=float(env("RESOLVE_INTERVAL", "5")),
                       help="seconds between re-resolving replica names and health checks")
        p.add_argument("--tokenizer", default=env("TOKENIZER"),
                       help="tokenizer directory (default: the target checkpoint)")
        p.add_argument("--target", default=env("TARGET_MODEL"), help="target checkpoint (for its tokenizer)")
        p.add_argument("--max-queue", type=int, default=int(env("MAX_QUEUE", "256")),
                       help="requests waiting for a KV slot before new ones get RESOURCE_EXHAUSTED")
        p.add_argument("--max-new-tokens", type=int, default=int(env("MAX_NEW_TOKENS", "256")),
                       help="default when a request leaves it 0")
        p.add_argument("--default-mode", choices=["auto", "chain", "tree", "off"], default=env("DEFAULT_MODE", "auto"),
                       help="speculation mode of requests that do not name one (auto: chosen per step from the "
                            "measured acceptance and step costs; see README)")
        add_metrics_argument(p, "GATEWAY")
        add_drain_argument(p)
        add_malloc_argument(p)
        add_server_tls_arguments(p)
        add_backend_tls_arguments(p)
        add_auth_arguments(p)
        p.add_argument("--backend-wait-seconds", type=float, default=float(env("BACKEND_WAIT_SECONDS", "10")),
                       help="while no verifier replica is healthy (restarting, reconnecting), requests wait this "
                            "long for one, and those of a lost verifier resume on the next healthy one from their "
                            "committed tokens; then UNAVAILABLE (env SPECDEC_BACKEND_WAIT_SECONDS; 0: at once)")
        p.add_argument("--max-request-bytes", type=int, default=int(env("MAX_REQUEST_BYTES", str(4 * 1024 * 1024))),
                       help="largest GenerateRequest accepted, in bytes; larger ones get RESOURCE_EXHAUSTED "
                            "(env SPECDEC_MAX_REQUEST_BYTES; default 4 MiB)")
        p.add_argument("--max-n", type=int, default=int(env("MAX_N", "64")),
                       help="most samples (Sampling.n) one request may ask for (env SPECDEC_MAX_N); also capped "
                            "by the verifier's KV slots")
        p.add_argument("--admit-fraction", type=float, default=float(env("ADMIT_FRACTION", "0.125")),
                       help="waiting prompts join a verifier's running batch once they number this share of its "
                            "running requests (one step then takes in several: a step that takes in prompts has a "
                            "fixed cost), or once the oldest has waited --admit-max-wait-steps steps "
                            "(env SPECDEC_ADMIT_FRACTION)")
        p.add_argument("--admit-max-wait-steps", type=int, default=int(env("ADMIT_MAX_WAIT_STEPS", "4")),
                       help="most steps a prompt waits to be grouped with others (0: every prompt joins at the next "
                            "step; env SPECDEC_ADMIT_MAX_WAIT_STEPS)")
        p.add_argument("--k", type=int, default=int(env("CHAIN_K", "4")), help="default chain draft length")
        p.add_argument("--topk", type=int, default=int(env("TREE_TOPK", "4")))
        p.add_argument("--depth", type=int, default=int(env("TREE_DEPTH", "4")))
        p.add_argument("--budget", type=int, default=int(env("TREE_BUDGET", "16")))
        p.add_argument("--test-hold-dir", default=env("TEST_HOLD_DIR"),
                       help="tests only: a file DIR/<request_id> holding N stops that request after N tokens "
                            "until the file is removed (gateway/hold.py)")
        p.add_argument("--test-auto-cycle", action="store_true",
                       help="tests only: mode auto takes each of its choices in turn, one step each, instead of "
                            "the best one (exercises every switch between shapes)")

    @classmethod
    def from_args(cls, a: argparse.Namespace, tokenizer_dir: Path) -> GatewayConfig:
        drafter = None if (a.drafter or "none").lower() == "none" else a.drafter
        if a.admit_fraction < 0 or a.admit_max_wait_steps < 0:
            raise SystemExit("--admit-fraction and --admit-max-wait-steps must be >= 0")
        if a.max_request_bytes < 1024:
            raise SystemExit(f"--max-request-bytes {a.max_request_bytes} is too small: at least 1024")
        return cls(a.listen, a.verifier, drafter, tokenizer_dir, a.max_queue, a.max_new_tokens,
                   a.k, a.topk, a.depth, a.budget, a.resolve_interval,
                   Path(a.test_hold_dir) if a.test_hold_dir else None, default_mode=a.default_mode,
                   max_n=a.max_n, metrics_listen=a.metrics_listen, drain_seconds=a.drain_seconds, test_auto_cycle=a.test_auto_cycle,
                   tls=server_tls_from_args(a), backend_tls=backend_tls_from_args(a),
                   auth_tokens_file=Path(a.auth_tokens_file) if a.auth_tokens_file else None,
                   auth_tokens=tuple(t.strip() for t in (env("AUTH_TOKENS") or "").split(",") if t.strip()),
                   max_request_bytes=a.max_request_bytes, backend_wait_seconds=a.backend_wait_seconds,
                   admit_fraction=a.admit_fraction, admit_max_wait_steps=a.admit_max_wait_steps,
                   malloc_tuning=a.malloc_tuning)
