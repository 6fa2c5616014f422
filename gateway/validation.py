"""Turn a GenerateRequest message into a checked GenerationRequest, or say what to fix."""

from __future__ import annotations

import secrets
import uuid

from gateway.request import GenerationRequest, InvalidRequest, Mode, SpecSettings
from specdec.config import GatewayConfig
from specdec.limits import MAX_CHAIN_K, MAX_TREE_BUDGET, MAX_TREE_DEPTH, MAX_TREE_TOPK
from specdec.rpc import gateway_pb2
from specdec.sampling_params import SamplingParams

MAX_STOP_STRINGS = 16
MODES = {
    gateway_pb2.SPEC_MODE_CHAIN: Mode.CHAIN,
    gateway_pb2.SPEC_MODE_TREE: Mode.TREE,
    gateway_pb2.SPEC_MODE_OFF: Mode.OFF,
    gateway_pb2.SPEC_MODE_AUTO: Mode.AUTO,
}


def _in_range(name: str, value: int, lo: int, hi: int) -> int:
    if not lo <= value <= hi:
        raise InvalidRequest(f"{name}={value} is out of range; use {lo}..{hi}")
    return value


class RequestValidator:
    def __init__(self, cfg: GatewayConfig, tokenizer, vocab_size: int, max_context: int, max_draft_tokens: int,
                 max_sequences: int) -> None:
        self.cfg = cfg
        self.max_sequences = max_sequences  # n samples of one request share one verifier
        self.max_draft_tokens = max_draft_tokens  # what the verifier checks per sequence and step
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_context = max_context

    def prompt_ids(self, msg: gateway_pb2.GenerateRequest) -> list[int]:
        kind = msg.WhichOneof("prompt")
        if kind == "token_ids":
            ids = list(msg.token_ids.ids)
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidRequest(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        elif kind == "text" and msg.text:
            if msg.apply_chat_template:
                if not getattr(self.tokenizer, "chat_template", None):
                    raise InvalidRequest("this model's tokenizer has no chat template; send plain text")
                text = self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": msg.text}], add_generation_prompt=True, tokenize=False)
                ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            else:
                ids = self.tokenizer(msg.text)["input_ids"]
        else:
            ids = []
        if not ids:
            raise InvalidRequest("the prompt is empty: send text or token_ids")
        return ids

    def spec(self, msg: gateway_pb2.SpeculationConfig) -> SpecSettings:
        c = self.cfg
        mode = Mode(c.default_mode) if msg.mode == gateway_pb2.SPEC_MODE_UNSPECIFIED else MODES.get(msg.mode)
        if mode is None:
            raise InvalidRequest(f"unknown speculation mode {msg.mode}")
        if mode == Mode.AUTO and (msg.k or msg.topk or msg.depth or msg.budget):
            raise InvalidRequest("mode auto chooses k, topk, depth and budget itself: leave them 0, or name the "
                                 "mode (chain or tree) to fix them")
        most = self.max_draft_tokens
        return SpecSettings(
            mode=mode,
            k=_in_range("k", msg.k or c.default_k, 1, min(MAX_CHAIN_K, most)),
            overlap=msg.overlap if msg.HasField("overlap") else True,
            topk=_in_range("topk", msg.topk or c.default_topk, 1, MAX_TREE_TOPK),
            depth=_in_range("depth", msg.depth or c.default_depth, 1, MAX_TREE_DEPTH),
            budget=_in_range("budget", msg.budget or c.default_budget, 1, min(MAX_TREE_BUDGET, most)),
        )

    def sampling(self, msg: gateway_pb2.Sampling) -> tuple[SamplingParams, int]:
        seed = msg.seed if msg.HasField("seed") else secrets.randbits(64)
        params = SamplingParams(msg.temperature, msg.top_p or 1.0, msg.top_k, seed)
        problem = params.problem()
        if problem:
            raise InvalidRequest(problem)
        n, most = msg.n or 1, min(self.cfg.max_n, self.max_sequences)
        if not 1 <= n <= most:
            raise InvalidRequest(f"n={n} is out of range; use 1..{most} (the gateway's --max-n is {self.cfg.max_n}, "
                                 f"and a request's samples share one verifier's {self.max_sequences} KV slots)")
        return params, n

    def validate(self, msg: gateway_pb2.GenerateRequest) -> GenerationRequest:
        ids = self.prompt_ids(msg)
        max_new = msg.max_new_tokens or min(self.cfg.default_max_new_tokens, self.max_context - len(ids))
        if max_new < 1 or len(ids) + max_new > self.max_context:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new}) exceeds the context limit "
                f"({self.max_context}); lower max_new_tokens or shorten the prompt"
            )
        if len(msg.stop) > MAX_STOP_STRINGS or any(not s for s in msg.stop):
            raise InvalidRequest(f"stop takes at most {MAX_STOP_STRINGS} non-empty strings")
        sampling, n = self.sampling(msg.sampling)
        return GenerationRequest(
            request_id=msg.request_id or uuid.uuid4().hex,
            prompt_ids=ids,
            max_new_tokens=max_new,
            stop=list(msg.stop),
            stop_at_eos=msg.stop_at_eos if msg.HasField("stop_at_eos") else True,
            spec=self.spec(msg.speculation),
            sampling=sampling,
            n=n,
        )
