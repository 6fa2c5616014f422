"""Tensor-parallel layout: which heads, MLP columns and vocabulary rows each rank holds.

q heads and MLP columns split evenly; KV heads split evenly when the world size divides them,
and are replicated (each rank holds the one KV head its q heads use) when the world size is a
multiple of their count. The LM head is split by vocabulary rows (padded to a multiple of the
world size); embeddings are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from specdec.model.spec import ModelSpec


@dataclass(frozen=True)
class TPLayout:
    rank: int
    world: int
    heads: int          # q heads on this rank
    kv_heads: int       # KV heads on this rank
    kv_first: int       # global index of this rank's first KV head
    intermediate: int   # MLP columns on this rank
    vocab_shard: int    # LM-head rows per rank (the last rank's tail is padding)

    @classmethod
    def single(cls, spec: ModelSpec) -> TPLayout:
        return cls(0, 1, spec.num_heads, spec.num_kv_heads, 0, spec.intermediate_size, spec.vocab_size)

    @classmethod
    def for_rank(cls, spec: ModelSpec, rank: int, world: int) -> TPLayout:
        if world == 1:
            return cls.single(spec)
        problem = cls.problem(spec, world)
        if problem:
            raise ValueError(problem)
        heads = spec.num_heads // world
        if world <= spec.num_kv_heads:
            kv_heads, kv_first = spec.num_kv_heads // world, rank * (spec.num_kv_heads // world)
        else:  # replicate: ranks whose q heads share a KV head each hold a copy of it
            kv_heads, kv_first = 1, (rank * heads) // (spec.num_heads // spec.num_kv_heads)
        vocab_shard = -(-spec.vocab_size // world)
        return cls(rank, world, heads, kv_heads, kv_first, spec.intermediate_size // world, vocab_shard)

    @staticmethod
    def problem(spec: ModelSpec, world: int) -> str | None:
        kv = spec.num_kv_heads
        if spec.num_heads % world:
            return f"--tp {world} must divide the {spec.num_heads} attention heads"
        if kv % world and world % kv:
            return f"--tp {world} must divide the {kv} KV heads or be a multiple of them"
        if spec.intermediate_size % world:
            return f"--tp {world} must divide the MLP size {spec.intermediate_size}"
        return None

    def shard(self, name: str, tensor_rows: int) -> tuple[int, slice] | None:
        """(dim, slice) of a checkpoint tensor that this rank loads, or None for replicated ones."""
        d = tensor_rows  # head_dim for attention tensors
        if self.world == 1:
            return None
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            return 0, slice(self.rank * self.heads * d, (self.rank + 1) * self.heads * d)
        if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            return 0, slice(self.kv_first * d, (self.kv_first + self.kv_heads) * d)
        if name.endswith("o_proj.weight"):
            return 1, slice(self.rank * self.heads * d, (self.rank + 1) * self.heads * d)
        if name.endswith(("gate_proj.weight", "up_proj.weight", "gate_proj.bias", "up_proj.bias")):
            return 0, slice(self.rank * self.intermediate, (self.rank + 1) * self.intermediate)
        if name.endswith("down_proj.weight"):
            return 1, slice(self.rank * self.intermediate, (self.rank + 1) * self.intermediate)
        if name == "lm_head.weight":
            return 0, slice(self.rank * self.vocab_shard, (self.rank + 1) * self.vocab_shard)
        return None

    def reduces_bias(self, name: str) -> bool:
        """Biases after an all-reduce are added by rank 0 only (zeros elsewhere)."""
        return self.world > 1 and name.endswith(("o_proj.bias", "down_proj.bias"))


def all_reduce(x: torch.Tensor, layout: TPLayout) -> torch.Tensor:
    if layout.world > 1:
        dist.all_reduce(x)
    return x


def gather_vocab(logits: torch.Tensor, layout: TPLayout, vocab_size: int) -> torch.Tensor:
    """[..., vocab_shard] per rank -> [..., vocab_size] on every rank."""
    if layout.world == 1:
        return logits
    parts = [torch.empty_like(logits) for _ in range(layout.world)]
    dist.all_gather(parts, logits.contiguous())
    return torch.cat(parts, dim=-1)[..., :vocab_size]
