"""`specdec train-drafter`'s settings and the report it returns: plain data, so the command line can
be built without importing torch (every `specdec` command builds it, the gateway's included)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class TrainDrafterConfig:
    target: Path
    out: Path
    device: str = "cpu"
    seed: int = 0
    data: Path | None = None            # reuse sequences saved by an earlier run (--save-data)
    save_data: Path | None = None
    text: tuple[Path, ...] = ()         # local text files, learned at every position
    prompts: int | None = None          # how many built-in training prompts to answer (None: all)
    self_instruct: int = 2000           # prompts the target writes itself (before de-duplication)
    self_instruct_temperature: float = 0.8   # of those questions (0: greedy, one question per distinct request)
    heldout: int = 200                  # held-out prompts answered for the acceptance report
    max_new_tokens: int = 384
    samples_per_prompt: int = 1         # answers per training prompt: the greedy one, then sampled ones
    temperature: float = 0.8            # of the sampled answers
    gen_batch: int = 128
    draft_vocab: int = 8192
    aux_layers: tuple[int, ...] | None = None   # target layer INPUTS to capture (default low/mid/high)
    ttt_steps: int = 7
    decay: float = 0.8
    root_weight: float = 0.0            # extra loss weight on roots right after a missed draft (ttt_loss)
    epochs: float = 8.0
    max_train_seconds: float | None = None   # fewer steps if the epochs would take longer (schedule fitted)
    lr: float = 5e-4
    batch_tokens: int = 16384
    max_len: int = 1024
    eval_k: int = 6
    save_dtype: str = "bfloat16"


@dataclass
class TrainReport:
    sequences: int
    tokens: int
    heldout_sequences: int
    draft_vocab: int
    vocab_coverage: float
    steps: int
    seconds: float
    final_loss: float
    heldout_acceptance: list[float] = field(default_factory=list)   # per draft position, given earlier ones right
    heldout_mean_accepted_length: float = 0.0                        # chain of eval_k drafts, teacher-forced
    heldout_decode_mean_accepted_length: float = 0.0                 # the same along greedy decoding's roots
