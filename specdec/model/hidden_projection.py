"""The verifier's side of `--project-hidden-states HEAD`: an EAGLE-3 head's `fc` applied to the
captured hidden-state rows before they leave the GPU.

A head reads the target's states of three layers concatenated (3 x target hidden wide) and
projects them by `fc` (to its own hidden width) as its first operation. `fc` is linear and
applied per row, so applying it on the verifier gives the drafter exactly the tensor it would
have computed, from a third of the bytes on every hop (device -> host copy, verdict, gateway,
drafter step, host -> device copy). The drafter then runs with `--projected-hidden-states` (its
fc the identity). Both sides name the fc they hold by `fc_fingerprint`, in ServiceInfo, and
the gateway pairs a drafter only with a verifier that projects by its fc (or not at all, when
the drafter projects itself).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdec.model.eagle3 import Eagle3Spec, fc_fingerprint, read_head_state
from specdec.model.spec import ModelSpec


class HiddenProjection:
    def __init__(self, weight: torch.Tensor, aux_layers: tuple[int, ...], fingerprint: str) -> None:
        self.weight = weight              # [h, A]: the head's fc (A = aux layers x target hidden)
        self.aux_layers = aux_layers      # the target layers whose input states it reads, in order
        self.fingerprint = fingerprint

    @property
    def width(self) -> int:
        return self.weight.shape[0]

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., A] -> [..., h] in the rows' dtype."""
        return torch.nn.functional.linear(rows, self.weight.to(rows.dtype))


def load_projection(head_dir: str | Path, target: ModelSpec, dtype: torch.dtype,
                    device: torch.device) -> HiddenProjection:
    """Only the fc of the head in head_dir (published layout), checked against the target."""
    spec = Eagle3Spec.from_pretrained(head_dir, target)
    if spec.target_hidden_size != target.hidden_size:
        raise ValueError(f"{head_dir} reads target states {spec.target_hidden_size} wide; this target's are "
                         f"{target.hidden_size}")
    weight = read_head_state(head_dir).get("fc.weight")
    want = (spec.layer.hidden_size, len(spec.aux_layers) * target.hidden_size)
    if weight is None or tuple(weight.shape) != want:
        raise ValueError(f"{head_dir}: an EAGLE-3 head's fc.weight of shape {list(want)} for this target, "
                         f"got {None if weight is None else list(weight.shape)}")
    return HiddenProjection(weight.to(device, dtype), spec.aux_layers, fc_fingerprint(weight))
