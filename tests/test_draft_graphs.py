"""Drafter graphs, checked on the CPU: catch-up feeds through the graphed forward (padded to the
captured query lengths and batch buckets), greedy chains and tree expansions through the
captured draft loops (padded rows drafting into the scratch slot). Here "replay" runs the same eager code on the
static buffers, so any difference from the plain engine is the padding's or the buffers' fault:
over random steps of several sequences (misses, partial and full acceptance, overlap
pre-drafts, sequences opening and closing) every draft must be identical.
(tests/test_cuda_graphs_cuda.py covers the real replay on the GPU.)"""

from __future__ import annotations

import random

import torch

from drafter_svc.draft_graphs import DraftGraphs, _Captured, graph_fits
from drafter_svc.engine import DrafterEngine
from drafter_svc.types import ChainShape, DraftItem, DrafterStep, TreeShape
from specdec.model.loader import load_model
from specdec.model.runner import ModelRunner
from test_cuda_graphs import EagerGraphs


class EagerDrafts(DraftGraphs):
    replayed: set = set()  # keys replayed, over all instances

    def capture(self, log=None) -> None:
        self.captured = {(b, key): self._new(b, key) for b in self.batch_sizes for key in self.keys}

    def _replay(self, c: _Captured) -> None:
        self.replayed.add(c.key)
        self._body(c)


TREES = (TreeShape(2, 3, 5), TreeShape(3, 3, 8))  # the first captured, the second eager


def drafter(path, graphed: bool, device: str = "cpu", dtype=torch.float64) -> DrafterEngine:
    runner = ModelRunner(load_model(path, dtype, torch.device(device)))
    engine = DrafterEngine(runner, max_sequences=5, max_context=96)
    if graphed and device == "cuda":
        engine.capture_cuda_graphs()
    elif graphed:
        runner.graphs = EagerGraphs(lambda batch: runner.model(batch, runner.cache), runner.spec.vocab_size,
                                    runner.cache.num_slots - 1, runner.cache.slot_len, runner.device,
                                    (1, 2, 4, 5), (1, 2, 5, 9), dtype)
        runner.graphs.capture()
        engine.draft_graphs = EagerDrafts(runner, 5, chain_lengths=(2, 3, 5), tree_shapes=TREES[:1])
        engine.draft_graphs.capture()
    return engine


def test_graphed_drafts_equal_eager_drafts(checkpoints, monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    path = checkpoints["llama-gqa"]
    check_drafts(drafter(path, False), drafter(path, True), tol=1e-9)
    assert {TREES[0], 2, 3, 5} <= EagerDrafts.replayed  # the captured loops really ran


def check_drafts(eager: DrafterEngine, graphed: DrafterEngine, tol: float) -> None:
    rng = random.Random(5)
    contexts: dict[str, list[int]] = {}
    sent: dict[str, int] = {}
    replays = 0
    for step in range(1, 30):
        items = []
        for sid in [f"s{i}" for i in range(5)]:
            if sid not in contexts and rng.random() < 0.6:
                contexts[sid], sent[sid] = [rng.randrange(380) for _ in range(rng.randint(1, 20))], 0
            if sid not in contexts or rng.random() < 0.2:
                continue
            ctx = contexts[sid]
            assumed = [rng.randrange(380) for _ in range(rng.choice([0, 0, 1, 3]))]
            shape = rng.choice([ChainShape(1), ChainShape(2), ChainShape(3), ChainShape(5), *TREES])
            if isinstance(shape, TreeShape):
                assumed = []  # trees are drafted synchronously: nothing is assumed
            items.append(DraftItem(sid, len(ctx), ctx[sent[sid]:], assumed, shape))
            sent[sid] = len(ctx)
        if not items:
            continue
        want, got = eager.step(DrafterStep(step, items)), graphed.step(DrafterStep(step, items))
        assert not want.errors and not got.errors
        for w, g in zip(want.drafts, got.drafts):
            assert g.tree.token_ids == w.tree.token_ids, f"step {step} {w.seq_id}"
            assert max(abs(a - b) for a, b in zip(g.tree.logprobs, w.tree.logprobs)) < tol
            assert g.tree.parents == w.tree.parents
            kept = w.tree.token_ids[: rng.randrange(len(w.tree.token_ids) + 1)] if len(w.tree) and all(
                p == i for i, p in enumerate(w.tree.parents)) else []
            contexts[w.seq_id] += kept + [rng.randrange(380)]
        replays += 1
        done = [sid for sid, ctx in contexts.items() if len(ctx) > 80]
        for sid in done:  # close long sequences: their slots are reused by new ones
            eager.close([sid]), graphed.close([sid])
            del contexts[sid], sent[sid]
    assert replays > 20


def test_wide_trees_are_captured_only_where_their_nodes_fit():
    """Wide trees get graphs for the batches whose trees (root included) fit in the verifier's cap
    for a captured step (64 x 17 tokens): no larger memory pool; chains at every bucket."""
    fits = graph_fits(64)
    assert fits(64, TreeShape(4, 4, 16)) and fits(32, TreeShape(8, 6, 32)) and fits(16, TreeShape(8, 7, 64))
    assert not fits(48, TreeShape(8, 6, 32)) and not fits(32, TreeShape(8, 7, 64))
    assert fits(64, 7) and graph_fits(6)(1, TreeShape(8, 7, 64)) and not graph_fits(6)(2, TreeShape(8, 7, 64))
