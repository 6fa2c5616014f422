"""Llama-family decoder (Llama, Mistral, Qwen2) with its own batched forward over a KVCache.

Parameter names match Hugging Face checkpoints, so a safetensors state dict loads directly.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fused_norm import add_rms_norm
from kernels.invariant_attention import ancestor_paths
from kernels.rotary_kv import rope_and_write_kv
from kernels.tree_attention import tree_attention
from kernels.triton_support import use_triton
from specdec.model.batch import ForwardBatch
from specdec.model.kv_cache import KVCache
from specdec.model.layers import (GatedMLP, InvariantLinear, RMSNorm, RotaryEmbedding, apply_rotary, concat_linear,
                                   replace_linears)
from specdec.model.parallel import TPLayout, all_reduce, gather_vocab
from specdec.model.spec import ModelSpec


class Attention(nn.Module):
    """Self-attention over this rank's heads; o_proj is row-parallel (all-reduced by the caller)."""

    def __init__(self, spec: ModelSpec, layout: TPLayout, layer_idx: int, in_features: int | None = None) -> None:
        """in_features: what q, k and v read (default the hidden size; an EAGLE-3 head reads twice that)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = layout.heads, layout.kv_heads, spec.head_dim
        h = spec.hidden_size
        d_in = in_features or h
        self.q_proj = nn.Linear(d_in, self.num_heads * self.head_dim, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(d_in, self.num_kv_heads * self.head_dim, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=spec.o_bias)
        self.batch_invariant = False

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

    def fuse_projections(self) -> None:
        """q, k and v projections as one matmul (forward_fused); the separate ones are dropped."""
        self.qkv_proj = concat_linear([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def forward_fused(self, x, cos, sin, batch: ForwardBatch, cache: KVCache, paths=None) -> torch.Tensor:
        """paths: the batch's ancestor paths when batch-invariant (computed once per forward)."""
        b, n, _ = x.shape
        q = rope_and_write_kv(self.qkv_proj(x), cos, sin, cache.k, cache.v, self.layer_idx, batch.slots,
                              batch.write_pos, self.num_heads, self.num_kv_heads)   # [B, n, H, D]
        out = tree_attention(q, cache.k, cache.v, self.layer_idx, batch.slots, batch.prefix_len,
                             batch.region_mask, batch.kv_len, ancestor_paths=paths)
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

    def forward_fused(self, h, residual, cos, sin, batch, cache, next_norm: RMSNorm, paths=None):
        """h: this layer's normalised input, residual: the stream before it -> the same pair for
        the next layer (normalised by next_norm): each residual add is fused with the norm after it."""
        attn = all_reduce(self.self_attn.forward_fused(h, cos, sin, batch, cache, paths), self.layout)
        norm = self.post_attention_layernorm
        h, residual = add_rms_norm(attn, residual, norm.weight, norm.eps)
        mlp = all_reduce(self.mlp.forward_fused(h), self.layout)
        return add_rms_norm(mlp, residual, next_norm.weight, next_norm.eps)


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
        self.fused = False

    def fuse_projections(self) -> None:
        """Switch to the fused forward: merged QKV and gate-up weights, residual adds fused with
        the norms, RoPE fused with the KV write (kernels/; Triton on CUDA, torch elsewhere)."""
        for layer in self.model.layers:
            layer.self_attn.fuse_projections()
            layer.mlp.fuse_projections()
        self.fused = True

    def make_batch_invariant(self) -> None:
        """Every matmul and attention call with one tile shape and reduction order whatever the
        batch (kernels/invariant_matmul.py): a sequence's logits no longer depend on the mode, the
        draft size or the other sequences in the step. Costs speed; see --batch-invariant."""
        replace_linears(self, InvariantLinear)
        for module in self.modules():
            if isinstance(module, Attention):
                module.batch_invariant = True

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache, logit_index: torch.Tensor | None = None) -> torch.Tensor:
        """Run the new tokens through all layers, writing their KV into `cache`.

        logit_index: [B, m] positions (into n) whose logits are wanted; None = all.
        Returns logits [B, m, V] in fp32 (fp64 for an fp64 model).
        """
        return self._forward(batch, cache, logit_index, ())[0]

    @torch.inference_mode()
    def forward_with_aux(self, batch: ForwardBatch, cache: KVCache, aux_layers: tuple[int, ...],
                         logit_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward, and the hidden states at the inputs of `aux_layers` (0..L; L = after the last
        layer, before the final norm), what an EAGLE-3 head drafts from, concatenated in that
        order: [B, n, len(aux_layers) * h], from the same pass. Before logit_index is applied."""
        logits, aux = self._forward(batch, cache, logit_index, aux_layers)
        return logits, torch.cat(aux, dim=-1)

    def _forward(self, batch, cache, logit_index, aux_layers) -> tuple[torch.Tensor, list[torch.Tensor]]:
        x = self.model.embed_tokens(batch.tokens)              # [B, n, h]
        cos, sin = self.model.rotary(batch.positions, x.dtype)  # [B, n, D]
        captured: dict[int, torch.Tensor] = {}
        if self.fused:
            x = self._layers_fused(x, cos, sin, batch, cache, aux_layers, captured)
        else:
            mask = None if use_triton(x) else batch.attention_mask()  # the Triton kernel masks on the fly
            for i, layer in enumerate(self.model.layers):
                if i in aux_layers:
                    captured[i] = x
                x = layer(x, cos, sin, batch, mask, cache)
            captured[len(self.model.layers)] = x  # "input of layer L": the stream before the final norm
        if logit_index is not None:
            x = torch.gather(x, 1, logit_index[:, :, None].expand(-1, -1, x.shape[-1]))
        if not self.fused:  # the fused layers end with the final norm applied
            x = self.model.norm(x)
        logits = gather_vocab(self.lm_head(x), self.layout, self.spec.vocab_size)
        return logits.to(torch.promote_types(logits.dtype, torch.float32)), [captured[i] for i in aux_layers]

    def _layers_fused(self, x, cos, sin, batch: ForwardBatch, cache: KVCache, aux_layers=(),
                      captured: dict | None = None) -> torch.Tensor:
        """All layers in the fused form -> the final-normed hidden states [B, n, h]; the residual
        stream at the input of each of aux_layers is copied into `captured` (it is updated in place)."""
        layers = self.model.layers
        first = layers[0].input_layernorm
        h, residual = add_rms_norm(x, None, first.weight, first.eps)
        paths = ancestor_paths(batch.region_mask) if layers[0].self_attn.batch_invariant and x.is_cuda else None
        for i, layer in enumerate(layers):
            if i in aux_layers:
                captured[i] = residual.clone()
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            h, residual = layer.forward_fused(h, residual, cos, sin, batch, cache, next_norm, paths)
        if captured is not None:
            captured[len(layers)] = residual  # "input of layer L": the stream before the final norm
        return h
