"""ModelRunner: the model and its KV cache behind the three calls engines make.

With tensor parallelism, rank 0's runner (TPLeader) broadcasts each call as a small command over
the collective backend before running its own shard (commands.py: tensors, no pickling); the
other ranks run `follow`, executing the same commands on their shards.
"""

from __future__ import annotations

import threading

import torch

from specdec.model import commands
from specdec.model.batch import ForwardBatch
from specdec.model.cuda_graphs import (
    PREFILL_MAX_TOKENS,
    PREFILL_QUERY_LENS,
    GraphedForward,
    batch_buckets,
    prefill_buckets,
    wide_step_tokens,
)
from specdec.model.kv_cache import KVCache
from specdec.model.llama import LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.spec = model.spec
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.cache: KVCache | None = None
        self.graphs: GraphedForward | None = None          # all-position logits: verify and draft steps
        self.prefill_graphs: GraphedForward | None = None  # one logit a row: prompt chunks
        self.aux_layers: tuple[int, ...] = ()  # target layers whose inputs forward_with_aux returns (EAGLE-3)

    def allocate_kv(self, num_slots: int, slot_len: int) -> None:
        """num_slots for sequences, and one more that no sequence owns: CUDA graphs' padding rows write there."""
        layout = self.model.layout
        self.cache = KVCache(self.spec.num_layers, num_slots + 1, slot_len, layout.kv_heads, self.spec.head_dim,
                             self.dtype, self.device)

    def capture_cuda_graphs(self, max_batch: int, query_lens: tuple[int, ...], log=None) -> None:
        """Capture the repeating forwards (see cuda_graphs.py), CUDA only: steps of every batch
        bucket and query length (wide ones only up to wide_step_tokens), and prompt chunks
        (PREFILL_QUERY_LENS). Under tensor parallelism every rank captures the same shapes in the
        same order (their collectives are captured with them) and replays the same graph for each
        forward command, so the collectives stay paired."""
        aux_width = len(self.aux_layers) * self.spec.hidden_size
        logits_dtype = torch.promote_types(self.dtype, torch.float32)
        scratch, slot_len = self.cache.num_slots - 1, self.cache.slot_len
        self.graphs = GraphedForward(self._model_forward, self.spec.vocab_size, scratch, slot_len, self.device,
                                     batch_buckets(max_batch), query_lens, logits_dtype, aux_width, self.dtype,
                                     max_tokens=wide_step_tokens(max_batch))
        self.graphs.capture(log)
        self.prefill_graphs = GraphedForward(self._model_forward, self.spec.vocab_size, scratch, slot_len,
                                             self.device, prefill_buckets(max_batch), PREFILL_QUERY_LENS,
                                             logits_dtype, aux_width, self.dtype, last_logit=True,
                                             max_tokens=PREFILL_MAX_TOKENS)
        self.prefill_graphs.capture(log)

    def _model_forward(self, batch: ForwardBatch, logit_index: torch.Tensor | None = None):
        if self.aux_layers:
            return self.model.forward_with_aux(batch, self.cache, self.aux_layers, logit_index)
        return self.model(batch, self.cache, logit_index)

    def _replay(self, batch: ForwardBatch, logit_index: torch.Tensor | None):
        """-> (logits, the graph family) by replaying the graph that fits, or None: run eagerly.
        The logits are a view of the family's static buffer: valid until the next forward."""
        family = self.graphs if logit_index is None else self.prefill_graphs
        logits = None if family is None else family.run(batch, logit_index)
        return None if logits is None else (logits, family)

    def forward(self, batch: ForwardBatch, logit_index: torch.Tensor | None = None) -> torch.Tensor:
        hit = self._replay(batch, logit_index)
        return hit[0] if hit is not None else self.model(batch, self.cache, logit_index)

    def forward_with_aux(self, batch: ForwardBatch,
                         logit_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """forward, plus the hidden states at the inputs of self.aux_layers for every position:
        [B, n, len(aux_layers) * hidden] (valid until the next forward, like the logits)."""
        hit = self._replay(batch, logit_index)
        if hit is not None:
            logits, family = hit
            return logits, family.aux_rows(*batch.tokens.shape)
        return self.model.forward_with_aux(batch, self.cache, self.aux_layers, logit_index)

    def move(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.cache.move(slots, src, dst)

    def copy_prefix(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, length: int) -> None:
        self.cache.copy_prefix(src_slots, dst_slots, length)

    def shutdown(self) -> None:
        pass


class TPLeader(ModelRunner):
    """Rank 0: tells the other ranks what to run, then runs its own shard."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        super().__init__(model)
        self.stopping = threading.Event()  # set before the other ranks are told to exit

    def _broadcast(self, name: str, *args) -> None:
        commands.send(self.device, name, *args)

    def allocate_kv(self, num_slots: int, slot_len: int) -> None:
        self._broadcast("allocate_kv", num_slots, slot_len)
        super().allocate_kv(num_slots, slot_len)

    def capture_cuda_graphs(self, max_batch: int, query_lens: tuple[int, ...], log=None) -> None:
        self._broadcast("capture_cuda_graphs", max_batch, torch.tensor(query_lens, dtype=torch.long))
        super().capture_cuda_graphs(max_batch, query_lens, log)

    def forward(self, batch: ForwardBatch, logit_index: torch.Tensor | None = None) -> torch.Tensor:
        self._broadcast_forward(batch, logit_index)
        return super().forward(batch, logit_index)

    def forward_with_aux(self, batch: ForwardBatch,
                         logit_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        self._broadcast_forward(batch, logit_index)  # the other ranks run the same collectives; aux stays here
        return super().forward_with_aux(batch, logit_index)

    def _broadcast_forward(self, b: ForwardBatch, logit_index: torch.Tensor | None) -> None:
        self._broadcast("forward", b.tokens, b.positions, b.slots, b.write_pos, b.prefix_len, b.region_mask,
                        b.kv_len, logit_index)

    def move(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        self._broadcast("move", slots, src, dst)
        super().move(slots, src, dst)

    def copy_prefix(self, src_slots: torch.Tensor, dst_slots: torch.Tensor, length: int) -> None:
        self._broadcast("copy_prefix", src_slots, dst_slots, length)
        super().copy_prefix(src_slots, dst_slots, length)

    def shutdown(self) -> None:
        self.stopping.set()
        self._broadcast("stop")


def follow(runner: ModelRunner) -> None:
    """Ranks > 0: execute rank 0's commands until it says stop."""
    while True:
        name, args = commands.receive(runner.device)
        if name == "stop":
            return
        if name == "allocate_kv":
            runner.allocate_kv(*args)
        elif name == "forward":
            *fields, logit_index = args
            runner.forward(ForwardBatch(*fields), logit_index)
        elif name == "move":
            runner.move(*args)
        elif name == "copy_prefix":
            runner.copy_prefix(*args)
        elif name == "capture_cuda_graphs":
            max_batch, query_lens = args
            runner.capture_cuda_graphs(max_batch, tuple(query_lens.tolist()))
        else:
            raise RuntimeError(f"unknown tensor-parallel command {name!r}")
