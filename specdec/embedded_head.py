"""The embedded default drafter: an EAGLE-3 head for the embedded SmolLM2-135M-Instruct target.

Trained by `specdec train-drafter` (TRAIN_COMMAND, fixed seed; about 10 minutes on one H200: 4.5 to
answer the prompt set and write self-instruct questions, 5.5 to train). The shipped file was made in
those two stages (`--save-data`, then `--data`), which start training from the same weights. It ships
inside the package in the published layout (config.json, bf16 model.safetensors, training_report.json),
so a fresh machine needs no training. Its weights are checked against HEAD_SHA256 before use: a
corrupted or hand-edited file is refused rather than silently drafting worse.
"""

from __future__ import annotations

import hashlib
from functools import cache
from pathlib import Path

HEAD_DIR = Path(__file__).parent / "assets" / "smollm2-135m-eagle3"
HEAD_SHA256 = "6416e3638baea1e2baa20258248aaaa9cd02b5fc28ceeb38ce4327780aea0251"
TRAIN_COMMAND = ("specdec train-drafter --device cuda --seed 0 --gen-batch 2048 --max-new-tokens 384 "
                 "--self-instruct 8000 --self-instruct-temperature 0.8 --epochs 20 "
                 "--out specdec/assets/smollm2-135m-eagle3")


@cache
def embedded_head() -> Path:
    """The shipped head's directory, after checking its checksum."""
    weights = HEAD_DIR / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"the embedded EAGLE-3 head is missing ({weights}); rebuild it with: {TRAIN_COMMAND}")
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    if digest != HEAD_SHA256:
        raise RuntimeError(f"{weights} has sha256 {digest}, expected {HEAD_SHA256}: the file is damaged or was "
                           f"replaced; restore it from the package or retrain with: {TRAIN_COMMAND}")
    return HEAD_DIR


def embedded_head_layers(target_dir: Path) -> tuple[int, ...]:
    """The target layers whose input hidden states the embedded head reads (the verifier sends them)."""
    from specdec.model.eagle3 import head_aux_layers

    return head_aux_layers(embedded_head(), target_dir)
