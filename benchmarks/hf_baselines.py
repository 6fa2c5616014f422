"""Hugging Face baselines at batch 1, in the same run: greedy `generate` of the target, and assisted
generation with the draft model as its assistant (a constant k draft tokens per round). For the
random pair the assistant's drafts are the draft model's own (near-zero acceptance: no control
exists inside HF); for the SmolLM2 pair both are the real models."""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from benchmarks.metrics import RunResult, SeqTrace, summarize
from benchmarks.models import ModelPair
from specdec.model.loader import DTYPES


class _Stamps(BaseStreamer):
    """Arrival times of generated tokens (generate's first put is the prompt). Only sizes are
    read here, so no extra device synchronization; generate synchronizes every step anyway."""

    def __init__(self, trace: SeqTrace) -> None:
        self.trace = trace
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        now = time.perf_counter()
        self.trace.first = now if self.trace.first is None else self.trace.first
        self.trace.last = now

    def end(self) -> None:
        pass


def _load(path, dtype: torch.dtype, device: str):
    try:  # straight onto the device (needs accelerate)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device)
    except (ImportError, ValueError):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.generation_config.eos_token_id = None  # fixed-length outputs, like the suite's requests
    return model.eval()


def _generate(model, prompt: list[int], max_new: int, device: str, **kw) -> SeqTrace:
    ids = torch.tensor([prompt], device=device)
    trace = SeqTrace(time.perf_counter())
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=0, streamer=_Stamps(trace), **kw)
    if device == "cuda":
        torch.cuda.synchronize()
    trace.last = time.perf_counter()
    trace.tokens = out[0, len(prompt):].tolist()
    return trace


def run_hf(pair: ModelPair, prompts: list[list[int]], max_new: int, device: str, dtype: str,
           k: int = 4) -> list[RunResult]:
    """HF generate and HF assisted generation over the prompts one after another (batch 1), each
    after a short warm-up."""
    dt = DTYPES[dtype]
    target = _load(pair.target, dt, device)
    assistant = _load(pair.draft, dt, device)
    cfg = assistant.generation_config
    cfg.num_assistant_tokens, cfg.num_assistant_tokens_schedule = k, "constant"
    cfg.assistant_confidence_threshold = 0.0  # always k tokens (no early stop on low confidence)
    rows = []
    for name, kw in (("hf generate", {}), (f"hf assisted k={k}", {"assistant_model": assistant})):
        _generate(target, prompts[0], 4, device, **kw)
        traces = [_generate(target, prompt, max_new, device, **kw) for prompt in prompts]
        rows.append(summarize(traces, "hf", pair.name, name, 1, None))
    del target, assistant
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows
