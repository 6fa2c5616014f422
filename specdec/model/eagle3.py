"""EAGLE-3 draft head: one decoder layer that drafts from the target model's own hidden states.

Layout of the checkpoints the EAGLE-3 authors publish (e.g. for Llama-3.1-8B-Instruct), which
this module loads as is: config.json of a one-layer Llama plus `draft_vocab_size` (and optionally
`target_hidden_size`, `eagle_config.eagle_aux_hidden_state_layer_ids`, `norm_before_residual`);
weights `fc` (3 x target hidden -> hidden), `midlayer.{input_layernorm, hidden_norm,
self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}`, `norm`, `lm_head`
(hidden -> draft vocabulary), `d2t` (draft id -> target id offset) and `t2d` (which target ids
the draft vocabulary holds). The token embeddings are the target's.

One step of the head, for a token x_t+1 and a hidden state h_t (the target's three captured
states concatenated and projected by `fc`, or the head's own previous output when it drafts on):

    a = attention(concat(input_layernorm(embed(x)), hidden_norm(h)))   # q/k/v read 2 x hidden
    h' = h + a;  out = h' + mlp(post_attention_layernorm(h'))
    draft logits = lm_head(norm(out));  target id = draft id + d2t[draft id]

`out` is the hidden state the next draft position feeds back in. The head's KV cache is its own
(one layer), addressed like the target's (ForwardBatch).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from kernels.triton_support import use_triton
from specdec.model.batch import ForwardBatch
from specdec.model.kv_cache import KVCache
from specdec.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, SkinnyLinear, replace_linears
from specdec.model.llama import Attention
from specdec.model.parallel import TPLayout
from specdec.model.spec import ModelSpec


@dataclass(frozen=True)
class Eagle3Spec:
    layer: ModelSpec                 # the mid-layer's shape (hidden size, heads, RoPE, vocabulary)
    target_hidden_size: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]      # target layers whose INPUT hidden states are captured, in order
    norm_before_residual: bool       # the residual is the normed hidden state (some trainers' variant)

    @classmethod
    def from_pretrained(cls, head_dir: str | Path, target: ModelSpec) -> Eagle3Spec:
        raw = json.loads((Path(head_dir) / "config.json").read_text())
        layer = ModelSpec.from_pretrained(head_dir)
        if layer.num_layers != 1:
            raise ValueError(f"an EAGLE-3 head has one decoder layer; {head_dir} declares {layer.num_layers}")
        if layer.vocab_size != target.vocab_size:
            raise ValueError(f"EAGLE-3 head vocabulary {layer.vocab_size} != target vocabulary {target.vocab_size}")
        # Checkpoints name the layers whose OUTPUT is captured; the output of layer i is the input of i + 1.
        outputs = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux = tuple(int(i) + 1 for i in outputs) if outputs else default_aux_layers(target.num_layers)
        if not all(0 <= i <= target.num_layers for i in aux):
            raise ValueError(f"aux hidden-state layers {aux} outside the target's 0..{target.num_layers}")
        return cls(layer, int(raw.get("target_hidden_size") or target.hidden_size),
                   int(raw.get("draft_vocab_size") or layer.vocab_size), aux,
                   bool(raw.get("norm_before_residual", False)))


def head_aux_layers(head_dir: str | Path, target_dir: str | Path) -> tuple[int, ...]:
    """The target layers whose input hidden states the head reads (the verifier's --aux-hidden-layers)."""
    return Eagle3Spec.from_pretrained(head_dir, ModelSpec.from_pretrained(target_dir)).aux_layers


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """Low, middle and high: the inputs of layers 2, L/2 and L-3 (what the EAGLE-3 authors use)."""
    return 2, num_layers // 2, num_layers - 3


class MidLayer(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        h = spec.hidden_size
        self.self_attn = Attention(spec, TPLayout.single(spec), 0, in_features=2 * h)
        self.mlp = GatedMLP(h, spec.intermediate_size, spec.mlp_bias)
        self.input_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)


class Eagle3Head(nn.Module):
    def __init__(self, spec: Eagle3Spec) -> None:
        super().__init__()
        h = spec.layer.hidden_size
        self.spec = spec
        self.fc = nn.Linear(len(spec.aux_layers) * spec.target_hidden_size, h, bias=False)
        self.midlayer = MidLayer(spec.layer)
        self.norm = RMSNorm(h, spec.layer.rms_norm_eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(spec.layer.vocab_size, dtype=torch.bool))
        self.rotary = RotaryEmbedding(*spec.layer.rope_inv_freq())

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, embeds: torch.Tensor, hidden: torch.Tensor,
                from_target: bool, last: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds [B, n, h] (the target's embeddings of batch.tokens); hidden: from_target, the
        captured target states [B, n, 3 x target h] (projected by fc), else the head's own previous
        outputs [B, n, h] -> (draft-vocabulary logits [B, n, Vd] in fp32 or wider, hidden out [B, n, h]);
        with last [B] (a position per row), only there: ([B, Vd], [B, h]) (a feed of real pairs
        needs the KV of every position but the outputs of its last only)."""
        if from_target:
            hidden = self.fc(hidden)
        layer = self.midlayer
        normed = layer.hidden_norm(hidden)
        residual = normed if self.spec.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(embeds), normed], dim=-1)          # [B, n, 2h]
        cos, sin = self.rotary(batch.positions, x.dtype)
        mask = None if use_triton(x) else batch.attention_mask()  # the Triton kernel masks on the fly
        h = residual + layer.self_attn(x, cos, sin, batch, mask, cache)   # (every position's KV written)
        if last is not None:
            h = h[torch.arange(h.shape[0], device=h.device), last]
        out = h + layer.mlp(layer.post_attention_layernorm(h))
        logits = self.lm_head(self.norm(out))
        return logits.to(torch.promote_types(logits.dtype, torch.float32)), out

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def read_head_state(head_dir: str | Path) -> dict[str, torch.Tensor]:
    """A head's tensors as stored (model.safetensors or pytorch_model.bin), the target's embeddings
    that some trainers save too left out."""
    head_dir = Path(head_dir)
    files = sorted(head_dir.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if not files:
        bins = sorted(head_dir.glob("*.bin"))
        if not bins:
            raise FileNotFoundError(f"no *.safetensors or *.bin weights in {head_dir}")
        for f in bins:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
    state.pop("embed_tokens.weight", None)
    return state


def fc_fingerprint(fc_weight: torch.Tensor) -> str:
    """Names the projection a head's `fc` makes: the first 16 hex digits of the sha256 of its
    weight as stored, so a verifier that projects and a drafter that expects projected rows can
    tell whether they hold the same fc whatever dtype each loaded it in."""
    raw = fc_weight.detach().contiguous().cpu().flatten().view(torch.uint8).numpy()
    return hashlib.sha256(raw.tobytes()).hexdigest()[:16]


def load_eagle3(head_dir: str | Path, target: ModelSpec, dtype: torch.dtype, device: torch.device,
                projected: bool = False) -> Eagle3Head:
    """A head saved in the published layout. projected: the verifier applies its `fc`
    (--project-hidden-states), so the head takes rows of its own width and its fc is the identity.
    The head's `fc_fingerprint` names its fc either way."""
    head_dir = Path(head_dir)
    spec = Eagle3Spec.from_pretrained(head_dir, target)
    state = read_head_state(head_dir)
    with torch.device("meta"):
        head = Eagle3Head(spec)
    expected = set(head.state_dict())
    missing, unknown = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or unknown:
        raise ValueError(f"{head_dir} is not an EAGLE-3 head of this target: missing {missing[:5]}, "
                         f"unknown {unknown[:5]}")
    buffers = {"d2t": torch.long, "t2d": torch.bool}
    head.load_state_dict({k: v.to(buffers.get(k, dtype)) for k, v in state.items()}, assign=True)
    head.rotary.inv_freq = spec.layer.rope_inv_freq()[0]
    head.fc_fingerprint = fc_fingerprint(state["fc.weight"])
    if projected:
        head.fc = nn.Identity()
    if device.type == "cpu":
        replace_linears(head, SkinnyLinear)
    return head.to(device).eval()
