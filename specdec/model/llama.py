"""Llama-family decoder (Llama, Mistral, Qwen2) with its own batched forward over a KVCache.

Parameter names match Hugging Face checkpoints, so a safetensors state dict loads directly.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.tree_attention import tree_attention
from kernels.triton_support import use_triton
from specdec.model.batch import ForwardBatch
from specdec.model.kv_cache import KVCache
from specdec.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from specdec.model.parallel import TPLayout, all_reduce, gather_vocab
from specdec.model.spec import ModelSpec


class Attention(nn.Module):
    """Self-attention over this rank's heads; o_proj is row-parallel (all-reduced by the caller)."""

    def __init__(self, spec: ModelSpec, layout: TPLayout, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = layout.heads, layout.kv_heads, spec.head_dim
        h = spec.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=spec.o_bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: ForwardBatch,
        mask: torch.Tensor | None,
        cache: KVCache,
    ) -> torch.Tensor:
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        cache.write(self.layer_idx, batch.slots, batch.write_pos, k, v)
        out = tree_attention(q, cache.k, cache.v, self.layer_idx, batch.slots, batch.prefix_len,
                             batch.region_mask, batch.kv_len, mask)   # [B, n, H, D]
        return self.o_proj(out.reshape(b, n, -1))


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layout: TPLayout, layer_idx: int) -> None:
        super().__init__()
        self.layout = layout
        self.self_attn = Attention(spec, layout, layer_idx)
        self.mlp = GatedMLP(spec.hidden_size, layout.intermediate, spec.mlp_bias)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, cos, sin, batch, mask, cache):
        x = x + all_reduce(self.self_attn(self.input_layernorm(x), cos, sin, batch, mask, cache), self.layout)
        return x + all_reduce(self.mlp(self.post_attention_layernorm(x)), self.layout)


class DecoderModel(nn.Module):
    def __init__(self, spec: ModelSpec, layout: TPLayout) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)  # replicated on every rank
        self.layers = nn.ModuleList(DecoderLayer(spec, layout, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(*spec.rope_inv_freq())


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, layout: TPLayout | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.layout = layout or TPLayout.single(spec)
        self.model = DecoderModel(spec, self.layout)
        self.lm_head = nn.Linear(spec.hidden_size, self.layout.vocab_shard, bias=False)  # vocabulary-parallel
        if spec.tie_word_embeddings and self.layout.world == 1:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """Run the new tokens through all layers, writing their KV into `cache`.

        logit_index: [B, m] positions (into n) whose logits are wanted; None = all.
        Returns logits [B, m, V] in fp32 (fp64 for an fp64 model).
        """
        x = self.model.embed_tokens(batch.tokens)              # [B, n, h]
        cos, sin = self.model.rotary(batch.positions, x.dtype)  # [B, n, D]
        mask = None if use_triton(x) else batch.attention_mask()  # the Triton kernel masks on the fly
        for layer in self.model.layers:
            x = layer(x, cos, sin, batch, mask, cache)
        if logit_index is not None:
            x = torch.gather(x, 1, logit_index[:, :, None].expand(-1, -1, x.shape[-1]))
        logits = gather_vocab(self.lm_head(self.model.norm(x)), self.layout, self.spec.vocab_size)
        return logits.to(torch.promote_types(logits.dtype, torch.float32))
