"""Arguments of `specdec train-drafter` and the report it prints."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from specdec.train.config import TrainDrafterConfig, TrainReport

DEFAULTS = TrainDrafterConfig(Path("."), Path("."))


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = DEFAULTS
    p.add_argument("--target", default=None, help="target checkpoint dir (default: the embedded SmolLM2)")
    p.add_argument("--out", required=True, help="where the head is saved (config.json, model.safetensors)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--seed", type=int, default=d.seed, help="fixes the prompt set, the split and the initial weights")
    p.add_argument("--data", default=None, help="reuse the training sequences an earlier run saved with --save-data")
    p.add_argument("--save-data", default=None, help="save the training sequences (token ids) to this file")
    p.add_argument("--text", nargs="*", default=[], help="local text files to learn from as well (every position)")
    p.add_argument("--prompts", type=int, default=None, help="built-in training prompts to answer (default: all)")
    p.add_argument("--self-instruct", type=int, default=d.self_instruct,
                   help="prompts the target writes itself (self-instruct); 0 to skip")
    p.add_argument("--self-instruct-temperature", type=float, default=d.self_instruct_temperature,
                   help="sampling temperature of those questions (nucleus 0.95; their answers stay greedy). 0: "
                        "greedy, which repeats itself: at most one question per request template and topic")
    p.add_argument("--heldout", type=int, default=d.heldout, help="held-out prompts for the acceptance report")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens, help="longest self-distilled answer")
    p.add_argument("--samples-per-prompt", type=int, default=d.samples_per_prompt,
                   help="answers per training prompt: the greedy one, then sampled ones (more distinct contexts)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="of the sampled answers")
    p.add_argument("--gen-batch", type=int, default=d.gen_batch, help="prompts answered per generate batch")
    p.add_argument("--draft-vocab", type=int, default=d.draft_vocab, help="draft vocabulary size")
    p.add_argument("--aux-layers", default=None,
                   help="target layer inputs whose hidden states the head reads, e.g. 2,15,27 (default low/mid/high)")
    p.add_argument("--ttt-steps", type=int, default=d.ttt_steps, help="draft positions unrolled in training")
    p.add_argument("--root-weight", type=float, default=d.root_weight,
                   help="extra loss weight on roots right after a missed first draft: greedy decoding starts "
                        "its steps there far more often than at a random position (0: every root alike)")
    p.add_argument("--epochs", type=float, default=d.epochs)
    p.add_argument("--max-train-seconds", type=float, default=None,
                   help="train for at most about this long: fewer steps than --epochs gives if the measured step "
                        "rate says so, the learning-rate schedule fitted to them (a machine lent by the minute)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--batch-tokens", type=int, default=d.batch_tokens, help="padded tokens per training batch")
    p.add_argument("--max-len", type=int, default=d.max_len, help="longest training sequence (tokens)")
    p.add_argument("--eval-k", type=int, default=d.eval_k, help="draft positions in the held-out report")
    p.add_argument("--save-dtype", default=d.save_dtype, choices=["bfloat16", "float16", "float32"])


def config_from_args(a: argparse.Namespace, target: Path) -> TrainDrafterConfig:
    aux = tuple(int(x) for x in a.aux_layers.split(",")) if a.aux_layers else None
    return TrainDrafterConfig(
        target=target, out=Path(a.out), device=a.device, seed=a.seed, data=Path(a.data) if a.data else None,
        save_data=Path(a.save_data) if a.save_data else None, text=tuple(Path(t) for t in a.text),
        prompts=a.prompts, self_instruct=a.self_instruct,
        self_instruct_temperature=a.self_instruct_temperature, heldout=a.heldout, max_new_tokens=a.max_new_tokens,
        samples_per_prompt=a.samples_per_prompt, temperature=a.temperature, gen_batch=a.gen_batch,
        draft_vocab=a.draft_vocab, aux_layers=aux, ttt_steps=a.ttt_steps, root_weight=a.root_weight, epochs=a.epochs,
        max_train_seconds=a.max_train_seconds, lr=a.lr, batch_tokens=a.batch_tokens, max_len=a.max_len,
        eval_k=a.eval_k, save_dtype=a.save_dtype)


def print_report(report: TrainReport, out: Path) -> None:
    digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    print(f"trained {report.steps} steps in {report.seconds:.0f} s on {report.sequences} sequences "
          f"({report.tokens} tokens); final loss {report.final_loss:.3f}")
    print(f"draft vocabulary {report.draft_vocab} tokens, covering {report.vocab_coverage:.1%} of answer tokens")
    print(f"held-out ({report.heldout_sequences} answers), greedy chain acceptance per draft position:")
    for j, a in enumerate(report.heldout_acceptance):
        print(f"  position {j + 1}: {a:.3f}")
    print(f"held-out mean accepted length, chain of {len(report.heldout_acceptance)}: "
          f"{report.heldout_mean_accepted_length:.2f} from every root, "
          f"{report.heldout_decode_mean_accepted_length:.2f} along greedy decoding (what serving sees)")
    print(f"saved {out}/model.safetensors  sha256 {digest}")
