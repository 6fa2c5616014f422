"""Measure how well layer-subset drafts of the embedded SmolLM2 target predict it.

For each prompt the target's greedy continuation is generated once. Each candidate draft
(built with ``specdec.embedded_model.derive_draft``) is then run over the same sequence
with teacher forcing, and we count the positions where the draft's greedy next token
equals the target's. From the per-token acceptance rate ``a`` we report the expected
number of tokens per verification step of a chain of ``k`` drafted tokens,
``(1 - a**(k+1)) / (1 - a)``, the draft's relative cost, and the resulting ideal speedup.

Run from the repository root:  python scripts/eval_embedded_draft.py
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # allow running without installing
from specdec.embedded_model import DEFAULT_DRAFT_LAYERS, derive_draft, ensure_embedded_models  # noqa: E402

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a CPU cache is.",
    "List three uses of Python.",
    "What is the capital of France, and what is it famous for?",
    "Give me a recipe for a simple tomato soup.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
]

N_TARGET_LAYERS = 30


def candidates() -> dict[str, list[int]]:
    """Named layer subsets of the 30-layer target to evaluate."""
    last = lambda n: list(range(N_TARGET_LAYERS - n, N_TARGET_LAYERS))  # noqa: E731
    first = lambda n: list(range(n))  # noqa: E731
    return {
        "first 4": first(4),
        "first 6": first(6),
        "first 8": first(8),
        "first 10": first(10),
        "first 2 + last 2": first(2) + last(2),
        "first 3 + last 1": first(3) + last(1),
        "first 3 + last 3": first(3) + last(3),
        "first 4 + last 1": first(4) + last(1),
        "first 4 + last 2": first(4) + last(2),
        "first 5 + last 3": first(5) + last(3),
        "first 6 + last 2": first(6) + last(2),
        "first 8 + last 2": first(8) + last(2),
        "every 5th (0,5,..,25) + 29": list(range(0, 30, 5)) + [29],
    }


def relative_flops(n_layers: int, hidden: int = 576, inter: int = 1536, kv: int = 192, vocab: int = 49152) -> float:
    """Per-token matmul cost of an ``n_layers`` draft relative to the full target (head included)."""
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter
    return (n_layers * per_layer + hidden * vocab) / (N_TARGET_LAYERS * per_layer + hidden * vocab)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("-k", type=int, default=4, help="draft chain length")
    args = parser.parse_args()
    torch.manual_seed(0)

    target_dir, _ = ensure_embedded_models(args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    # Target greedy continuations: (full sequence, prompt length) per prompt.
    sequences: list[tuple[torch.Tensor, int]] = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for prompt in PROMPTS:
            messages = [{"role": "user", "content": prompt}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
            out = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
            sequences.append((out, ids.shape[1]))
    print(f"target continuations: {time.perf_counter() - t0:.1f}s")
    print(f"example: {tokenizer.decode(sequences[0][0][0, sequences[0][1]:])!r}\n")

    k = args.k
    header = f"{'candidate':<28} {'layers':>6} {'a':>6} {'E[len] k=' + str(k):>11} {'cost L/30':>9} {'cost FLOP':>9} {'speedup':>7}"
    print(header)
    print("-" * len(header))
    with tempfile.TemporaryDirectory(prefix="specdec-draft-eval-") as tmp:
        for i, (name, layers) in enumerate(candidates().items()):
            draft_dir = Path(tmp) / f"draft{i}"
            derive_draft(target_dir, draft_dir, layers)
            draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
            hits = total = 0
            with torch.inference_mode():
                for seq, prompt_len in sequences:
                    # logits at position t predict token t+1; compare over the continuation only.
                    pred = draft(seq).logits[0, prompt_len - 1 : -1].argmax(-1)
                    hits += int((pred == seq[0, prompt_len:]).sum())
                    total += seq.shape[1] - prompt_len
            a = hits / total
            expected = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0
            c = relative_flops(len(layers))
            # Ideal speedup: tokens per step over the cost of k draft steps plus one target pass.
            speedup = expected / (k * c + 1)
            mark = " *" if tuple(layers) == DEFAULT_DRAFT_LAYERS else ""
            print(f"{name:<28} {len(layers):>6} {a:>6.3f} {expected:>11.2f} {len(layers) / N_TARGET_LAYERS:>9.3f} "
                  f"{c:>9.3f} {speedup:>7.2f}{mark}")
            del draft
            sys.stdout.flush()
    print("\n* = DEFAULT_DRAFT_LAYERS")


if __name__ == "__main__":
    main()
