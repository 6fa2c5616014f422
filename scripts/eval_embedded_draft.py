"""Measure how well layer-subset drafts of the embedded SmolLM2 target predict it.

For each prompt the target's greedy continuation is generated once. A draft that keeps a
subset of the target's layers is then run over the same sequence with teacher forcing,
and we count the positions where the draft's greedy next token equals the target's. From
the per-token acceptance rate ``a`` we report the expected number of tokens per
verification step of a chain of ``k`` drafted tokens, ``(1 - a**(k+1)) / (1 - a)``, the
draft's relative cost, and the ideal speedup ``E[len] / (k * cost + 1)``.

Prompts are split into a search set and a held-out set. ``--search`` additionally runs a
greedy layer-dropping search on the search set (this is how ``DEFAULT_DRAFT_LAYERS`` was
chosen) and reports held-out acceptance along the way.

Run from the repository root:  python scripts/eval_embedded_draft.py [--search]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # allow running without installing
from specdec.embedded_model import DEFAULT_DRAFT_LAYERS, derive_draft, ensure_embedded_models  # noqa: E402

SEARCH_PROMPTS = [
    "Write a short poem about the sea.",
    "Explain what a CPU cache is.",
    "List three uses of Python.",
    "What is the capital of France, and what is it famous for?",
    "Give me a recipe for a simple tomato soup.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
]
HELDOUT_PROMPTS = [
    "Describe how a bicycle works.",
    "Write a haiku about autumn leaves.",
    "What are the benefits of regular exercise?",
    "Explain the difference between a list and a tuple in Python.",
    "Tell me a fun fact about octopuses.",
    "How do I make a cup of green tea?",
]
N_LAYERS = 30
Sequences = list[tuple[torch.Tensor, int]]  # (prompt + greedy continuation, prompt length)


def candidates() -> dict[str, list[int]]:
    """Named layer subsets of the 30-layer target to evaluate."""
    table = {f"first {n}": list(range(n)) for n in (4, 6, 8, 10, 15, 20, 25)}
    for n, m in ((2, 2), (3, 3), (4, 2), (6, 2), (10, 5)):
        table[f"first {n} + last {m}"] = list(range(n)) + list(range(N_LAYERS - m, N_LAYERS))
    table |= {
        "every 2nd": list(range(0, N_LAYERS, 2)),
        "all but 14": [i for i in range(N_LAYERS) if i != 14],
        "default": list(DEFAULT_DRAFT_LAYERS),
    }
    return table


def relative_cost(n_layers: int, hidden: int = 576, inter: int = 1536, kv: int = 192, vocab: int = 49152) -> float:
    """Per-token matmul FLOPs of an ``n_layers`` draft relative to the target (tied head included)."""
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter
    return (n_layers * per_layer + hidden * vocab) / (N_LAYERS * per_layer + hidden * vocab)


def greedy_continuations(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: list[str], new_tokens: int
) -> Sequences:
    """The target's greedy continuation of each chat-templated prompt."""
    out: Sequences = []
    for prompt in prompts:
        messages = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")["input_ids"]
        out.append((model.generate(ids, max_new_tokens=new_tokens, do_sample=False), ids.shape[1]))
    return out


def acceptance(model: PreTrainedModel, seqs: Sequences) -> float:
    """Fraction of continuation positions where ``model``'s greedy token equals the target's."""
    hits = total = 0
    for seq, prompt_len in seqs:
        # Logits at position t predict token t+1: compare over the continuation only.
        pred = model(seq, use_cache=False).logits[0, prompt_len - 1 : -1].argmax(-1)
        hits += int((pred == seq[0, prompt_len:]).sum())
        total += seq.shape[1] - prompt_len
    return hits / total


def subset_acceptance(target: PreTrainedModel, layers: list[int], seqs: Sequences) -> float:
    """Acceptance of the draft keeping ``layers``, evaluated in place by temporarily swapping the
    target's layer list (equivalent to ``derive_draft`` without a KV cache, but much faster)."""
    full = target.model.layers
    target.model.layers = torch.nn.ModuleList([full[i] for i in layers])
    try:
        return acceptance(target, seqs)
    finally:
        target.model.layers = full


def row(name: str, layers: list[int], a_search: float, a_held: float, k: int) -> str:
    a = a_held
    expected = (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1.0
    cost = relative_cost(len(layers))
    return (
        f"{name:<20} {len(layers):>3} {a_search:>8.3f} {a_held:>6.3f} {expected:>7.2f} "
        f"{len(layers) / N_LAYERS:>6.3f} {cost:>6.3f} {expected / (k * cost + 1):>7.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("-k", type=int, default=4, help="draft chain length")
    parser.add_argument("--search", action="store_true", help="also run the greedy layer-dropping search")
    args = parser.parse_args()
    torch.set_grad_enabled(False)

    target_dir, draft_dir = ensure_embedded_models(args.cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    t0 = time.perf_counter()
    search = greedy_continuations(target, tokenizer, SEARCH_PROMPTS, args.max_new_tokens)
    held = greedy_continuations(target, tokenizer, HELDOUT_PROMPTS, args.max_new_tokens)
    print(f"target continuations: {time.perf_counter() - t0:.1f}s")
    print(f"example: {tokenizer.decode(search[0][0][0, search[0][1] :])!r}\n")

    header = (
        f"{'candidate':<20} {'L':>3} {'a search':>8} {'a held':>6} {'E[len]':>7} "
        f"{'L/30':>6} {'FLOPs':>6} {'speedup':>7}"
    )
    print(f"{header}\n{'-' * len(header)}")
    print(f"(E[len], speedup: held-out a, k={args.k}; speedup = E[len] / (k * FLOPs + 1))")
    for name, layers in candidates().items():
        print(
            row(
                name, layers, subset_acceptance(target, layers, search), subset_acceptance(target, layers, held), args.k
            ),
            flush=True,
        )

    # Check that the checkpoints written by derive_draft behave like the in-place subsets.
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    print(f"\ncached default draft {draft_dir.name}: held-out a = {acceptance(draft, held):.3f}")
    with tempfile.TemporaryDirectory() as tmp:
        derive_draft(target_dir, Path(tmp) / "d", [0, 1, 2, 3, 28, 29])
        check = AutoModelForCausalLM.from_pretrained(Path(tmp) / "d", dtype=torch.float32).eval()
        print(f"derive_draft [0,1,2,3,28,29]: held-out a = {acceptance(check, held):.3f}")

    if args.search:
        # Greedy backward elimination: repeatedly drop the layer whose removal hurts search-set
        # acceptance least (layer 0 always kept), reporting held-out acceptance at each size.
        print(f"\ngreedy layer-dropping search\n{header}\n{'-' * len(header)}")
        keep = list(range(N_LAYERS))
        while len(keep) > 4:
            a_best, dropped = max((subset_acceptance(target, [x for x in keep if x != d], search), d) for d in keep[1:])
            keep.remove(dropped)
            print(row(f"drop {dropped}", keep, a_best, subset_acceptance(target, keep, held), args.k))
            print(f"    keep={keep}", flush=True)


if __name__ == "__main__":
    main()
