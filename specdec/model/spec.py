"""Typed, read-once description of a Llama-family checkpoint (from its config.json)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# RoPE variants whose frequencies do not depend on the running sequence length.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    hf_config: PretrainedConfig

    @classmethod
    def from_pretrained(cls, checkpoint_dir: str | Path) -> ModelSpec:
        cfg = AutoConfig.from_pretrained(str(checkpoint_dir))
        return cls.from_hf_config(cfg)

    @classmethod
    def from_hf_config(cls, cfg: PretrainedConfig) -> ModelSpec:
        if cfg.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {cfg.model_type!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}"
            )
        rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
        if rope_type not in STATIC_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; use one of {STATIC_ROPE_TYPES}")
        is_qwen2 = cfg.model_type == "qwen2"
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        heads = cfg.num_attention_heads
        return cls(
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            hf_config=cfg,
        )

    def rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        """Inverse frequencies [head_dim/2] (fp32) and the cos/sin scaling, as transformers computes them."""
        with torch.device("cpu"):  # also when the model is being built on the meta device
            return self._rope_inv_freq()

    def _rope_inv_freq(self) -> tuple[torch.Tensor, float]:
        params = getattr(self.hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(self.hf_config, "rope_theta", 10000.0))
            dim = self.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            return inv_freq, 1.0
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](self.hf_config, torch.device("cpu"))
        return inv_freq.float(), float(scaling)
