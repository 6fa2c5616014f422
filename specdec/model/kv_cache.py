"""Preallocated KV cache: one fixed-length slot per sequence, all layers in two tensors.

Rollback is free (a sequence's valid length lives with its owner; stale entries past it are
simply overwritten), and tree compaction moves the accepted path's entries to a dense prefix.
Slots are handed out by the engine's SequenceTable.
"""

from __future__ import annotations

import torch

from kernels.kv_compact import compact


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        slot_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_layers, num_slots, slot_len, num_kv_heads, head_dim)
        # Zeros, not empty: masked keys still enter the attention product, and 0 * NaN = NaN.
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, S, T, Hkv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.num_slots = num_slots
        self.slot_len = slot_len

    def write(self, layer: int, slots: torch.Tensor, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # slots: [B]; pos: [B, n]; k, v: [B, n, Hkv, D]
        self.k[layer, slots[:, None], pos] = k
        self.v[layer, slots[:, None], pos] = v

    def read(self, layer: int, slots: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        # -> k, v: [B, length, Hkv, D] (positions past a sequence's own length are masked by the caller)
        return self.k[layer, slots, :length], self.v[layer, slots, :length]

    def move(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy entries src -> dst within each slot, all layers at once (tree compaction).

        slots: [B]; src, dst: [B, m]. Pad rows with src == dst (a no-op move).
        """
        compact(self.k, self.v, slots, src, dst)

    def copy_prefix(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, length: int) -> None:
        """Copy the first `length` entries of each src slot into its dst slot (shared prefills)."""
        self.k[:, dst_slots, :length] = self.k[:, src_slots, :length]
        self.v[:, dst_slots, :length] = self.v[:, src_slots, :length]
