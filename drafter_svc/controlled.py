"""Controlled-acceptance drafter, for benchmarks: the draft model runs its real forwards (so a
step costs what it costs), then each draft is rewritten so the target accepts it with a known
probability `a`.

The target's greedy continuation of each benchmark prompt is known in advance (the reference
file, written by a first mode-off pass: see specdec/config.py ControlledAcceptance). A draft
node at absolute position p of a sequence (0-based, prompt included) is rewritten as follows:

- the nodes on the path from the root to the tree's first deepest node (a chain: every node)
  become reference[p] with probability a, otherwise a token != reference[p] (the drafted one,
  or reference[p] + 1 mod V if the model happened to draft reference[p]);
- every other node keeps its drafted token unless that token is reference[p], which becomes
  reference[p] + 1 mod V, so that only the path can be accepted.

So a step accepts exactly the leading kept nodes of that path: P(at least d accepted) = a^d,
mean accepted length (bonus included) (1 - a^(D+1)) / (1 - a) for a path of D nodes. The keep
draw is counter-based, a hash of (seed, prompt hash, p) (specdec.sampling.uniforms): an overlap
pre-draft and a later re-draft of the same position decide alike, whatever the batch.

Exact for greedy requests whose committed tokens follow the reference (mode off is lossless, so
they do unless low-precision rounding flips an argmax). Positions past the reference, and
sequences whose prompt has no reference (warm-up), keep their drafts. Rewritten drafts carry no
proposal distributions: the verifier then treats every node as a point mass, which keeps sampled
requests lossless too (their acceptance is no longer `a`).
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from drafter_svc.eagle3_engine import Eagle3DrafterEngine
from drafter_svc.engine import DrafterEngine
from drafter_svc.types import DrafterStep, DrafterStepResult
from specdec.config import ControlledAcceptance
from specdec.model.runner import ModelRunner
from specdec.sampling import uniforms
from specdec.tree import DraftTree, tree_structure

KEEP = 0x4B45  # purpose ("salt") of the keep draws; their seeds are per prompt, not per request


def prompt_seed(seed: int, prompt: tuple[int, ...]) -> int:
    """64-bit seed of one prompt's keep draws, as an int64 bit pattern."""
    digest = hashlib.blake2b(struct.pack(f"<Q{len(prompt)}q", seed % (1 << 64), *prompt), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


class ControlledRewrite:
    """The rewrite, mixed into a drafter engine class (its step and close run first)."""

    def _init_control(self, control: ControlledAcceptance | None) -> None:
        self._row_of: dict[str, int | None] = {}  # seq id -> reference row (None: no reference)
        self.control = control

    @property
    def control(self) -> ControlledAcceptance | None:
        return self._control

    @control.setter
    def control(self, control: ControlledAcceptance | None) -> None:
        """Index the references once: [R, W] prompt + output table (-1 = past the end), a lookup
        by prompt, and each prompt's keep-draw seed."""
        self._control = control
        self._row_of.clear()
        refs = control.references if control else ()
        full = [list(p) + list(o) for p, o in refs]
        self._table = np.full((len(full), max(map(len, full), default=1)), -1, dtype=np.int64)
        for i, row in enumerate(full):
            self._table[i, : len(row)] = row
        self._by_prompt: dict[int, dict[tuple[int, ...], int]] = {}
        for i, (prompt, _) in enumerate(refs):
            self._by_prompt.setdefault(len(prompt), {}).setdefault(tuple(prompt), i)
        seeds = np.array([prompt_seed(control.seed, p) for p, _ in refs], dtype=np.int64)
        # Each reference position's keep draw, once: a step then only looks them up  [R, W]
        positions = np.broadcast_to(np.arange(self._table.shape[1]), self._table.shape)
        self._keep = (uniforms(seeds, positions, KEEP) < control.acceptance if len(refs)
                      else np.zeros(self._table.shape, dtype=bool))

    def close(self, seq_ids: list[str]) -> None:
        super().close(seq_ids)  # the engine's
        for sid in seq_ids:
            self._row_of.pop(sid, None)

    def step(self, req: DrafterStep) -> DrafterStepResult:
        for item in req.items:  # a sequence (re)opened by this step is matched afresh
            if self.table.get(item.seq_id) is None:
                self._row_of.pop(item.seq_id, None)
        result = super().step(req)
        if self._control is None:
            return result
        drafts = [d for d in result.drafts if len(d.tree) and self._row(d.seq_id) is not None]
        if drafts:
            self._rewrite(drafts)
        return result

    def _row(self, seq_id: str) -> int | None:
        """The reference whose prompt is the longest prefix of the sequence (looked up once)."""
        if seq_id not in self._row_of:
            tokens = self.table.get(seq_id).tokens
            hits = [(n, rows.get(tuple(tokens[:n]))) for n, rows in self._by_prompt.items() if n <= len(tokens)]
            self._row_of[seq_id] = max(((n, r) for n, r in hits if r is not None), default=(0, None))[1]
        return self._row_of[seq_id]

    def _rewrite(self, drafts: list) -> None:
        """All drafts of the step at once, on the host in numpy (the trees are host lists already;
        torch's per-operator cost on tiny CPU tensors was 1.7 ms of a batch-32 step on an H100)."""
        rows = np.array([self._row_of[d.seq_id] for d in drafts], dtype=np.int64)
        n = 1 + max(len(d.tree) for d in drafts)
        # node 0 = the root (the last context token, not rewritten), then the draft nodes, padded  [B, n]
        tokens = np.array([[0, *d.tree.token_ids, *[0] * (n - 1 - len(d.tree))] for d in drafts], dtype=np.int64)
        node = np.arange(n)[None, :]
        real = (node >= 1) & (node < np.array([1 + len(d.tree) for d in drafts])[:, None])   # draft nodes
        if all(d.tree.parents == list(range(len(d.tree))) for d in drafts):   # chains: the path is every node
            depth, on_path = np.broadcast_to(node, tokens.shape), real
        else:
            parents = np.array([[-1, *d.tree.parents, *[-1] * (n - 1 - len(d.tree))] for d in drafts], dtype=np.int64)
            ancestors, depth = tree_structure(parents, max(d.tree.shape()[0] for d in drafts))
            deepest = np.where(real, depth, -1).argmax(1)                     # first node of maximal depth
            on_path = ancestors[np.arange(len(drafts)), deepest] & real       # it and its ancestors
        # The root is the last context token (position L + A - 1); a node at depth d sits d past it.
        base = np.array([d.committed_len + d.assumed_len - 1 for d in drafts], dtype=np.int64)
        pos = base[:, None] + depth                                           # [B, n]
        at = np.minimum(pos, self._table.shape[1] - 1)
        ref = self._table[rows[:, None], at]
        keep = self._keep[rows[:, None], at]
        has_ref = real & (pos < self._table.shape[1]) & (ref >= 0)
        other = np.where(tokens == ref, (ref + 1) % self.table.vocab_size, tokens)
        new = np.where(has_ref, np.where(on_path & keep, ref, other), tokens)
        for d, row in zip(drafts, new[:, 1:].tolist()):
            tree = d.tree
            d.tree = DraftTree(row[: len(tree)], tree.parents, tree.logprobs)


class ControlledAcceptanceDrafter(ControlledRewrite, DrafterEngine):
    """A draft model's drafts, rewritten."""

    def __init__(self, runner: ModelRunner, max_sequences: int, max_context: int,
                 control: ControlledAcceptance | None = None) -> None:
        DrafterEngine.__init__(self, runner, max_sequences, max_context)
        self._init_control(control)


class ControlledEagle3Drafter(ControlledRewrite, Eagle3DrafterEngine):
    """An EAGLE-3 head's drafts, rewritten (build_eagle3_drafter(..., engine_class=this, control=...)):
    the head's real step cost, the verifier's real hidden-state traffic, a known acceptance."""

    def __init__(self, *args, control: ControlledAcceptance | None = None, **kwargs) -> None:
        Eagle3DrafterEngine.__init__(self, *args, **kwargs)
        self._init_control(control)
