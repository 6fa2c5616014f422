"""Teacher-forced acceptance of an EAGLE-3 head on held-out prompts, without serving it.

The target answers the held-out chat prompts (greedy, Hugging Face `generate`); the head then
drafts chains of k from the target's real hidden states along those answers (the training-time
unroll, `specdec/train/ttt.py`). Two figures come out:

- from every root: the chain from each answer position; what training reports;
- along greedy decoding: the roots a server visits (each step starts after the last step's
  accepted drafts and bonus token). This is what `bench_serve.py` measures as "accept len" on
  the same prompts (same answers, same hidden states), at a fraction of the cost, and it is lower:
  a step starts right after a miss more often than a random position does.

Run from the repository root (the embedded target and its shipped head by default):
    python scripts/eval_head.py --num-prompts 16 --max-new-tokens 128 --k 4
    python scripts/eval_head.py --num-prompts 16 --max-new-tokens 128 --k 4 --hidden-states-fp8
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # allow running without installing
from specdec.train.prompts import build_prompts  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target checkpoint (default: the embedded SmolLM2)")
    p.add_argument("--head", default=None, help="EAGLE-3 head directory (default: the shipped head)")
    p.add_argument("--num-prompts", type=int, default=16, help="the first N held-out prompts (as bench_serve)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="chain length")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=16, help="prompts answered at once")
    p.add_argument("--hidden-states-fp8", action="store_true",
                   help="the head reads the target's states packed to float8 and back, as the verifier's "
                        "--hidden-states-fp8 sends them")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdec.embedded_head import embedded_head
    from specdec.embedded_model import ensure_embedded_models
    from specdec.model.eagle3 import load_eagle3
    from specdec.model.fp8_rows import dequantize_rows, quantize_rows
    from specdec.model.spec import ModelSpec
    from specdec.train.distill import self_distill
    from specdec.train.trainer import evaluate
    from specdec.train.vocab import DraftVocab

    a = parse_args(argv)
    device = torch.device(a.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_dir = Path(a.target) if a.target else ensure_embedded_models()[0]
    head_dir = Path(a.head) if a.head else embedded_head()
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    head = load_eagle3(head_dir, ModelSpec.from_pretrained(target_dir), torch.float32, device)
    vocab = DraftVocab(torch.arange(head.spec.draft_vocab_size) + head.d2t.cpu(), 1.0)
    prompts = build_prompts(seed=0).heldout[:a.num_prompts]
    samples = self_distill(target, tokenizer, prompts, a.max_new_tokens, a.batch)
    wire = (lambda rows: dequantize_rows(quantize_rows(rows), rows.dtype)) if a.hidden_states_fp8 else None
    stats = evaluate(head, target, samples, vocab, a.k, 16384, 1024, device, wire)
    result = {"prompts": len(samples), "answer_tokens": sum(len(s.ids) - s.answer_start for s in samples),
              "k": a.k, "per_position_every_root": stats.per_position(),
              "mean_accepted_length_every_root": stats.mean_accepted_length(),
              "decode_steps": stats.decode_steps,
              "first_draft_right_decoding": stats.decode_first_right / max(stats.decode_steps, 1),
              "mean_accepted_length_decoding": stats.decode_mean_accepted_length()}
    if a.json:
        print(json.dumps(result))
    else:
        print(f"{result['prompts']} held-out prompts, {result['answer_tokens']} answer tokens, chains of {a.k}")
        print("acceptance per draft position (every root, given the earlier ones right): "
              + " ".join(f"{x:.3f}" for x in result["per_position_every_root"]))
        print(f"mean accepted length: {result['mean_accepted_length_every_root']:.2f} from every root, "
              f"{result['mean_accepted_length_decoding']:.2f} along greedy decoding ({stats.decode_steps} steps, "
              f"first draft right at {result['first_draft_right_decoding']:.3f} of them)")
    return result


if __name__ == "__main__":
    main()
