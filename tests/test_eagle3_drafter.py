"""EAGLE-3 drafter engine: the target's hidden states arrive with the committed tokens (rows for
all positions but the last), the head's KV of real pairs is kept across steps and its drafted
positions are redone from real states later, overlap pre-drafts feed the head's own outputs for
assumed tokens -- and every draft of one long-lived sequence equals a fresh engine's draft from
the whole context (so the incremental bookkeeping is exact). The first drafted token is the
published architecture's argmax mapped through d2t. Trees: a one-wide tree is the chain, each
node's best child is what the head drafts after that node, and long-lived trees equal fresh ones.
Missing hidden states (and assumed tokens for a tree) are refused."""

from __future__ import annotations

import random

import pytest
import torch
from test_eagle3_head import reference, write_head

from drafter_svc.eagle3_engine import Eagle3DrafterEngine
from drafter_svc.types import ChainShape, DraftItem, DrafterStep, TreeShape
from specdec.model.batch import ForwardBatch, causal_region
from specdec.model.eagle3 import load_eagle3
from specdec.model.fp8_rows import dequantize_rows, quantize_rows
from specdec.model.kv_cache import KVCache
from specdec.model.loader import load_model


def setup(checkpoints, tmp_path):
    target_dir = checkpoints["llama-gqa"]
    write_head(target_dir, tmp_path / "head")
    target = load_model(target_dir, torch.float64, torch.device("cpu"))
    return target, tmp_path / "head"


def engine(target, head_dir) -> Eagle3DrafterEngine:
    head = load_eagle3(head_dir, target.spec, torch.float64, torch.device("cpu"))
    return Eagle3DrafterEngine(head, target.model.embed_tokens.weight, max_sequences=3, max_context=128)


def target_states(target, aux, tokens: list[int]) -> torch.Tensor:
    """What the verifier's verdicts carry for a committed sequence: [len - 1, aux width]."""
    s = target.spec
    cache = KVCache(s.num_layers, 1, 160, s.num_kv_heads, s.head_dim, torch.float64, torch.device("cpu"))
    n = len(tokens) - 1
    pos = torch.arange(n)[None]
    batch = ForwardBatch.build(torch.tensor([tokens[:-1]]), pos, torch.tensor([0]), pos, torch.tensor([0]),
                               causal_region(torch.tensor([n]), n))
    return target.forward_with_aux(batch, cache, aux)[1][0]


def test_incremental_drafts_equal_drafting_from_scratch(checkpoints, tmp_path):
    target, head_dir = setup(checkpoints, tmp_path)
    eng = engine(target, head_dir)
    aux = eng.head.spec.aux_layers
    rng = random.Random(4)
    context = [5, 6, 7, 9]
    sent = 0
    for step in range(1, 16):
        states = target_states(target, aux, context)
        assumed = [rng.randrange(380) for _ in range(rng.choice([0, 0, 1, 3]))]
        k = rng.choice([1, 2, 4])
        rows = states[max(0, sent - 1):]  # opening: all; later: the appended tokens' predecessors
        res = eng.step(DrafterStep(step, [DraftItem("s", len(context), context[sent:], assumed, ChainShape(k),
                                                    hidden=rows)]))
        assert not res.errors, res.errors
        sent = len(context)
        fresh = engine(target, head_dir).step(DrafterStep(1, [DraftItem(
            "s", len(context), context, assumed, ChainShape(k), hidden=states)]))
        assert res.drafts[0].tree.token_ids == fresh.drafts[0].tree.token_ids, f"step {step}"
        assert res.drafts[0].assumed_len == len(assumed)
        drafted = res.drafts[0].tree.token_ids
        kept = drafted[: rng.randrange(len(drafted) + 1)] if not assumed else []
        context += kept + [rng.randrange(380)] * rng.choice([0, 1, 1])


def test_first_draft_is_the_architectures_argmax(checkpoints, tmp_path):
    import json

    target, head_dir = setup(checkpoints, tmp_path)
    eng = engine(target, head_dir)
    tokens = [3, 14, 15, 92, 65, 35]
    states = target_states(target, eng.head.spec.aux_layers, tokens)
    res = eng.step(DrafterStep(1, [DraftItem("s", len(tokens), tokens, [], ChainShape(1), hidden=states)]))
    head_state = {k: v.double() if v.is_floating_point() else v for k, v in eng.head.state_dict().items()}
    cfg = json.loads((head_dir / "config.json").read_text())
    with torch.no_grad():
        embeds = target.model.embed_tokens.weight[torch.tensor(tokens[1:])]
        logits, _ = reference(head_state, cfg, embeds, states)
    want = int(eng.head.to_target_ids(logits[-1].argmax()[None])[0])
    assert res.drafts[0].tree.token_ids == [want]
    assert abs(res.drafts[0].tree.logprobs[0] - float(torch.log_softmax(logits[-1], -1).max())) < 1e-9


def test_a_step_of_chains_and_trees_drafts_each_as_alone(checkpoints, tmp_path):
    """Items of different shapes in one step (as --mode auto sends them) are drafted in groups by
    shape: each item's draft equals the draft it gets in a step of its own."""
    target, head_dir = setup(checkpoints, tmp_path)
    contexts = {"a": [3, 14, 15, 92, 65], "b": [35, 89, 79, 32, 38, 46], "c": [43, 38, 7]}
    shapes = {"a": ChainShape(3), "b": TreeShape(2, 3, 5), "c": ChainShape(2)}
    aux = engine(target, head_dir).head.spec.aux_layers
    items = {sid: DraftItem(sid, len(ctx), ctx, [], shapes[sid], hidden=target_states(target, aux, ctx))
             for sid, ctx in contexts.items()}
    together = engine(target, head_dir).step(DrafterStep(1, list(items.values())))
    assert not together.errors
    for d in together.drafts:
        alone = engine(target, head_dir).step(DrafterStep(1, [items[d.seq_id]])).drafts[0]
        assert (d.tree.token_ids, d.tree.parents) == (alone.tree.token_ids, alone.tree.parents), d.seq_id
        assert max(abs(x - y) for x, y in zip(d.tree.logprobs, alone.tree.logprobs)) < 1e-9


def test_missing_states_and_trees_are_refused(checkpoints, tmp_path):
    target, head_dir = setup(checkpoints, tmp_path)
    eng = engine(target, head_dir)
    tokens = [1, 2, 3]
    res = eng.step(DrafterStep(1, [
        DraftItem("a", 3, tokens, [], ChainShape(2)),                                   # no states at all
        DraftItem("b", 3, tokens, [], ChainShape(2), hidden=torch.zeros(1, eng.aux_width)),  # one row short
        DraftItem("c", 3, tokens, [7], TreeShape(2, 2, 3), hidden=torch.zeros(2, eng.aux_width)),  # trees: no overlap
    ]))
    assert [e.code.name for e in res.errors] == ["INVALID"] * 3 and not res.drafts
    assert "--aux-hidden-layers" in res.errors[0].message
    assert len(eng.table) == 0  # nothing was opened


def test_trees_follow_the_head_node_by_node(checkpoints, tmp_path):
    target, head_dir = setup(checkpoints, tmp_path)
    eng = engine(target, head_dir)
    context = [3, 14, 15, 92, 65, 35]
    sent = 0

    def fresh(assumed, shape):
        states = target_states(target, eng.head.spec.aux_layers, context)
        res = engine(target, head_dir).step(DrafterStep(1, [DraftItem("s", len(context), context, assumed, shape,
                                                                      hidden=states)]))
        return res.drafts[0].tree

    for step in range(1, 5):
        states = target_states(target, eng.head.spec.aux_layers, context)
        res = eng.step(DrafterStep(step, [DraftItem("s", len(context), context[sent:], [], TreeShape(2, 2, 6),
                                                    hidden=states[max(0, sent - 1):])]))
        assert not res.errors, res.errors
        sent = len(context)
        tree = res.drafts[0].tree
        assert (tree.token_ids, tree.parents) == (fresh([], TreeShape(2, 2, 6)).token_ids,
                                                  fresh([], TreeShape(2, 2, 6)).parents), f"step {step}"
        # budget 6 keeps every candidate: two children of the root, two under each of them
        assert tree.parents == [0, 0, 1, 1, 2, 2]
        for node in (1, 2):
            children = [tree.token_ids[i] for i, p in enumerate(tree.parents) if p == node]
            best = max(children, key=lambda t: tree.logprobs[tree.token_ids.index(t)])
            assert best == fresh([tree.token_ids[node - 1]], ChainShape(1)).token_ids[0], (step, node)
        # one wide: the chain of the same depth
        assert fresh([], TreeShape(1, 4, 4)).token_ids == fresh([], ChainShape(4)).token_ids
        context += tree.token_ids[:1] + [step + 30]


class _EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: replay runs the captured body on the statics."""

    def __init__(self, body, c) -> None:
        self.body, self.c = body, c
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        before = self.c.outputs
        self.body(self.c)
        if before:   # as a graph: each replay writes the same output buffers
            for buffer, out in zip(before, self.c.outputs):
                buffer.copy_(out)
            self.c.outputs = before


def graphed(eng: Eagle3DrafterEngine, device: str, max_batch: int = 3, **limits) -> Eagle3DrafterEngine:
    from drafter_svc.eagle3_graphs import HEDGE_STEPS, Eagle3Graphs, _Captured, _CapturedHedges, _CapturedPairs

    if device == "cuda":
        eng.capture_cuda_graphs()
        assert eng.graphs.hedges_captured or not eng.hedge_predrafts
        return eng
    eng.graphs = g = Eagle3Graphs(eng, max_batch, chain_steps=(2, 4, 5, 6), tree_shapes=GRAPHED_TREES, **limits)
    for b in g.batch_sizes:
        for key in g.keys:
            c = g.captured[(b, key)] = _Captured(key, b, eng)
            c.graph = _EagerReplay(g._body, c)
        for n in g.pair_lens:
            if g.pairs_fit(b, n):
                c = g.pairs_captured[(b, n)] = _CapturedPairs(n, b, eng, g.pairs_hidden)
                c.graph = _EagerReplay(g._pairs_body, c)
    for r in g.hedge_sizes:
        for steps in HEDGE_STEPS:
            c = g.hedges_captured[(r, steps)] = _CapturedHedges(steps, r, eng)
            c.graph = _EagerReplay(g._hedge_body, c)
    return eng


# a default tree and a wide one (on the GPU captured for up to 4 rows of a drafter of 8 slots)
GRAPHED_TREES = (TreeShape(4, 4, 16), TreeShape(8, 6, 32))


def check_graphed_equals_eager(target, head_dir, device: str, dtype=torch.float64, tol=1e-9,
                               projected: bool = False) -> None:
    """Three sequences (a padded bucket of 4), one with a prompt of 20 tokens (its feed padded to
    32 pairs), chains with and without assumed tokens and trees (a default and a wide one): the
    replayed loops draft the eager engine's tokens, and hedges drafted from the replayed chains'
    alternatives equal those from eager ones. projected: rows arrive projected by the head's fc."""
    from specdec.model.hidden_projection import load_projection

    def make():
        head = load_eagle3(head_dir, target.spec, dtype, torch.device(device), projected)
        return Eagle3DrafterEngine(head, target.model.embed_tokens.weight.to(device, dtype), 8, 128,
                                   hedge_predrafts=True)

    project = load_projection(head_dir, target.spec, dtype, torch.device(device)) if projected else lambda x: x

    eager, fast = make(), graphed(make(), device)
    contexts = {"a": [3, 14, 15, 92, 65] * 4, "b": [35, 89, 79, 32, 38, 46, 26], "c": [43, 38]}
    sent = dict.fromkeys(contexts, 0)
    rng = random.Random(7)
    hedged = 0
    for step in range(1, 7):
        tree = step % 3 == 0
        items = []
        for sid, ctx in contexts.items():
            states = project(target_states(target, eager.head.spec.aux_layers, ctx).to(device, dtype))
            shape = GRAPHED_TREES[step // 3 - 1] if tree else ChainShape(rng.choice([2, 4]))
            assumed = [] if tree else [rng.randrange(380) for _ in range(rng.choice([0, 2]))]
            items.append(DraftItem(sid, len(ctx), ctx[sent[sid]:], assumed, shape,
                                   hidden=states[max(0, sent[sid] - 1):]))
            sent[sid] = len(ctx)
        want, got = eager.step(DrafterStep(step, items)), fast.step(DrafterStep(step, items))
        assert not want.errors and not got.errors
        for w, g in zip(want.drafts, got.drafts):
            assert (w.tree.token_ids, w.tree.parents) == (g.tree.token_ids, g.tree.parents), (step, w.seq_id)
            assert max(abs(a - b) for a, b in zip(w.tree.logprobs, g.tree.logprobs)) < tol
            assert w.hedges.keys() == g.hedges.keys()
            for j, h in w.hedges.items():
                assert h.token_ids == g.hedges[j].token_ids, (step, w.seq_id, j)
                assert max(abs(a - b) for a, b in zip(h.logprobs, g.hedges[j].logprobs)) < tol
            hedged += len(w.hedges)
        for sid, d in zip(contexts, want.drafts):
            contexts[sid] += d.tree.token_ids[:1] + [rng.randrange(380)]
    assert hedged > 0
    bucket = fast.graphs._bucket(len(contexts))
    assert all((bucket, shape) in fast.graphs.captured for shape in GRAPHED_TREES)   # the trees were replayed
    if device == "cpu":   # and the prompt's feed (alone in its group: bucket 1)
        assert fast.graphs.pairs_captured[(1, 32)].graph.replays == 1


@pytest.mark.parametrize("projected", [False, True], ids=["rows", "projected-rows"])
def test_replayed_draft_loops_equal_eager_ones(checkpoints, tmp_path, projected):
    target, head_dir = setup(checkpoints, tmp_path)
    check_graphed_equals_eager(target, head_dir, "cpu", projected=projected)


@pytest.mark.parametrize("replayed", [False, True], ids=["eager", "graph-padded"])
def test_fp8_rows_draft_as_their_unpacked_values(checkpoints, tmp_path, replayed):
    """Rows packed by the verifier (--hidden-states-fp8) are unpacked on the drafter's device: the
    drafts, chains and trees, equal those drafted from the same values sent unpacked."""
    target, head_dir = setup(checkpoints, tmp_path)
    packed_eng, plain_eng = (graphed(engine(target, head_dir), "cpu") if replayed else engine(target, head_dir)
                             for _ in range(2))
    aux = packed_eng.head.spec.aux_layers
    contexts = {"a": [3, 14, 15, 92, 65], "b": [35, 89, 79, 32, 38, 46, 26]}
    sent = dict.fromkeys(contexts, 0)
    for step in range(1, 6):
        shape = GRAPHED_TREES[0] if step % 3 == 0 else ChainShape(4)
        packed, plain = [], []
        for sid, ctx in contexts.items():
            rows = quantize_rows(target_states(target, aux, ctx)[max(0, sent[sid] - 1):])
            for items, hidden in ((packed, rows), (plain, dequantize_rows(rows, torch.float64))):
                items.append(DraftItem(sid, len(ctx), ctx[sent[sid]:], [], shape, hidden=hidden))
            sent[sid] = len(ctx)
        got, want = packed_eng.step(DrafterStep(step, packed)), plain_eng.step(DrafterStep(step, plain))
        assert not got.errors and not want.errors
        for g, w in zip(got.drafts, want.drafts):
            assert (g.tree.token_ids, g.tree.parents, g.tree.logprobs) == (w.tree.token_ids, w.tree.parents,
                                                                           w.tree.logprobs), (step, g.seq_id)
        for sid, d in zip(contexts, want.drafts):
            contexts[sid] += d.tree.token_ids[:1] + [step + 7]


def test_hedges_are_the_pre_drafts_after_each_guessed_correction(checkpoints, tmp_path):
    """--hedge-predrafts: an overlap pre-draft (assumed a, chain of k) also returns, for each j < len(a),
    a chain that starts with the head's best token other than a[j] after a[:j] (its guess of the
    verifier's correction) and continues exactly as a pre-draft assuming a[:j] + [that token]. Two
    sequences of different assumed lengths and k in one batch; the main pre-draft is unchanged;
    sampled requests and a drafter without the flag get no hedges."""
    from specdec.sampling import SamplingParams

    target, head_dir = setup(checkpoints, tmp_path)
    contexts = {"s": [3, 14, 15, 92, 65, 35], "t": [7, 1, 8, 2, 8]}
    states = {sid: target_states(target, engine(target, head_dir).head.spec.aux_layers, c) for sid, c in contexts.items()}

    def items(assumed: dict[str, list[int]], ks: dict[str, int], sampling=None):
        extra = {} if sampling is None else {"sampling": sampling}
        return [DraftItem(sid, len(contexts[sid]), contexts[sid], assumed[sid], ChainShape(ks[sid]),
                          hidden=states[sid], **extra) for sid in assumed]

    def fresh(sid: str, assumed: list[int], k: int):
        return engine(target, head_dir).step(DrafterStep(1, items({sid: assumed}, {sid: k}))).drafts[0]

    # assumed tokens: the head's own chain (so a[j] is its best and the hedge takes its second best),
    # with one position replaced (so there the hedge takes its best)
    own = {sid: fresh(sid, [], 4).tree.token_ids for sid in contexts}
    assumed = {"s": own["s"][:2] + [own["s"][2] + 1 if own["s"][2] < 300 else 0], "t": own["t"][:2]}
    ks = {"s": 4, "t": 3}
    hedging = Eagle3DrafterEngine(load_eagle3(head_dir, target.spec, torch.float64, torch.device("cpu")),
                                  target.model.embed_tokens.weight, max_sequences=3, max_context=128,
                                  hedge_predrafts=True)
    res = hedging.step(DrafterStep(1, items(assumed, ks)))
    assert not res.errors, res.errors
    saw_best = saw_second = False
    for d in res.drafts:
        a, k = assumed[d.seq_id], ks[d.seq_id]
        assert d.tree.token_ids == fresh(d.seq_id, a, k).tree.token_ids   # the main pre-draft
        assert sorted(d.hedges) == list(range(len(a)))
        for j, hedge in d.hedges.items():
            guess = hedge.token_ids[0]
            assert len(hedge) == k and guess != a[j]
            best = fresh(d.seq_id, a[:j], 1).tree.token_ids[0]
            if best != a[j]:
                assert guess == best
                saw_best = True
            else:
                saw_second = True
            after = fresh(d.seq_id, a[:j] + [guess], k - 1).tree
            assert hedge.token_ids[1:] == after.token_ids, (d.seq_id, j)
            assert max(abs(x - y) for x, y in zip(hedge.logprobs[1:], after.logprobs)) < 1e-9, (d.seq_id, j)
    assert saw_best and saw_second
    contexts["u"] = [4, 4, 2, 9]
    states["u"] = target_states(target, hedging.head.spec.aux_layers, contexts["u"])
    res = hedging.step(DrafterStep(3, items({"u": [5, 6]}, {"u": 3}, SamplingParams(temperature=0.7, seed=1))))
    assert not res.errors and res.drafts[0].hedges == {}
    assert all(not d.hedges for d in engine(target, head_dir).step(DrafterStep(1, items(assumed, ks))).drafts)


def test_a_prompt_is_fed_apart_from_the_catch_ups(checkpoints, tmp_path, monkeypatch):
    """A step where one sequence opens with a 20-token prompt and two others catch up a pair or
    three: the prompt's pairs get a forward of their own (padding the catch-ups to its length would
    feed each 19 pairs), and every draft equals a fresh engine's."""
    import drafter_svc.eagle3_engine as module

    target, head_dir = setup(checkpoints, tmp_path)
    eng = engine(target, head_dir)
    aux = eng.head.spec.aux_layers
    ctx = {"a": [3, 4, 5], "b": [9, 8], "new": [(13 * i) % 300 + 1 for i in range(20)]}
    eng.step(DrafterStep(1, [DraftItem(s, len(ctx[s]), ctx[s], [], ChainShape(2),
                                       hidden=target_states(target, aux, ctx[s])) for s in "ab"]))
    shapes, real = [], module.real_pairs_forward
    monkeypatch.setattr(module, "real_pairs_forward", lambda head, embed, cache, tokens, *rest, **kw:
                        shapes.append(tuple(tokens.shape)) or real(head, embed, cache, tokens, *rest, **kw))
    ctx["a"], ctx["b"] = ctx["a"] + [6], ctx["b"] + [7, 6, 5]
    items = []
    for sid, sent in (("a", 3), ("new", 0), ("b", 2)):
        rows = target_states(target, aux, ctx[sid])[max(0, sent - 1):]
        items.append(DraftItem(sid, len(ctx[sid]), ctx[sid][sent:], [], ChainShape(2), hidden=rows))
    res = eng.step(DrafterStep(2, items))
    assert not res.errors
    assert sorted(shapes) == [(1, 19), (2, 3)]
    for d in res.drafts:
        c = ctx[d.seq_id]
        fresh = engine(target, head_dir).step(DrafterStep(1, [DraftItem(
            "s", len(c), c, [], ChainShape(2), hidden=target_states(target, aux, c))]))
        assert d.tree.token_ids == fresh.drafts[0].tree.token_ids, d.seq_id


def test_prompt_feeds_pad_only_within_the_slot(checkpoints, tmp_path):
    """The attention reads a feed's keys up to its start + padded length: no pairs graph is longer
    than a slot (its capture would read past the KV cache: an illegal access on the GPU), and a
    feed near its slot's end is padded only as far as the slot reaches (else it runs eagerly)."""
    target, head_dir = setup(checkpoints, tmp_path)
    eng = graphed(engine(target, head_dir), "cpu")
    g, slot_len = eng.graphs, eng.slot_len
    assert all(n <= slot_len for _, n in g.pairs_captured) and (1, 128) in g.pairs_captured
    assert not g.pairs_fit(1, 256) and slot_len < 256
    fed = []
    g.pairs_captured[(1, 16)].graph.body = lambda c: fed.append(c.tokens.shape[1])   # what replays, and how wide
    hidden = torch.zeros(1, 9, eng.aux_width, dtype=torch.float64)
    for start, want in ((0, [16]), (slot_len - 16, [16]), (slot_len - 15, [])):
        fed.clear()
        out = g.real_pairs(torch.ones(1, 9, dtype=torch.long), hidden, torch.tensor([start]), torch.tensor([9]),
                           torch.tensor([0]))
        assert fed == want and (out is None) == (not want), start


def test_last_rows_of_blocks():
    """A sequence's states arrive in blocks; a feed takes the last rows of them, in order."""
    from drafter_svc.eagle3_engine import last_rows

    blocks = [torch.arange(3)[:, None], torch.arange(3, 4)[:, None], torch.arange(4, 7)[:, None]]
    for k, want in ((0, []), (2, [5, 6]), (4, [3, 4, 5, 6]), (6, [1, 2, 3, 4, 5, 6]), (9, list(range(7)))):
        taken = last_rows(blocks, k)
        assert (torch.cat(taken)[:, 0].tolist() if taken else []) == want, k


def test_a_feeds_rows_in_blocks_stage_as_in_one(checkpoints, tmp_path):
    """A feed's states may span blocks (each step's rows arrive as one), float8-packed or not: the head
    fed them sees what one block of the same values gives it, row for row, each sequence at its own
    rows of the padded feed."""
    target, head_dir = setup(checkpoints, tmp_path)
    eng = engine(target, head_dir)
    feeds = [[3, 14, 15, 92, 65], [35, 89]]
    states = [quantize_rows(torch.randn(len(f), eng.aux_width, dtype=torch.float64)) for f in feeds]
    slots = torch.tensor([0, 1])

    def fed(rows):
        return engine(target, head_dir)._pairs_forward([0, 0], feeds, rows, slots)

    plain = [[dequantize_rows(s, torch.float64)] for s in states]
    want = fed(plain)
    packed_blocks = [[s[:2], s[2:3], s[3:]] for s in states]   # (the second feed's last block is empty)
    mixed_blocks = [[s[:2], dequantize_rows(s[2:], torch.float64)] for s in states]
    for rows in (packed_blocks, mixed_blocks):
        got = fed(rows)
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_a_catch_up_wider_than_a_graph_replays_it_in_chunks(checkpoints, tmp_path):
    """Four sequences open at once with 20-token prompts (a switch from mode off sends every running
    sequence's history in one step) where a pairs graph holds at most 64 pairs: their 19 pairs each,
    padded to 32, replay the graph of two rows twice (not eagerly), and every draft of this and the
    next steps equals the eager engine's."""
    target, head_dir = setup(checkpoints, tmp_path)

    def make():
        head = load_eagle3(head_dir, target.spec, torch.float64, torch.device("cpu"))
        return Eagle3DrafterEngine(head, target.model.embed_tokens.weight, max_sequences=4, max_context=128)

    eager, fast = make(), graphed(make(), "cpu", max_batch=4, max_pair_tokens=64)
    assert (2, 32) in fast.graphs.pairs_captured and (4, 32) not in fast.graphs.pairs_captured
    aux = eager.head.spec.aux_layers
    contexts = {sid: [(7 * i + 31 * n) % 300 + 1 for i in range(20)] for n, sid in enumerate("abcd")}
    sent = dict.fromkeys(contexts, 0)
    for step in range(1, 4):
        items = [DraftItem(sid, len(ctx), ctx[sent[sid]:], [], ChainShape(4),
                           hidden=target_states(target, aux, ctx)[max(0, sent[sid] - 1):])
                 for sid, ctx in contexts.items()]
        sent = {sid: len(ctx) for sid, ctx in contexts.items()}
        want, got = eager.step(DrafterStep(step, items)), fast.step(DrafterStep(step, items))
        assert not want.errors and not got.errors
        for w, g in zip(want.drafts, got.drafts):
            assert w.tree.token_ids == g.tree.token_ids, (step, w.seq_id)
            assert max(abs(a - b) for a, b in zip(w.tree.logprobs, g.tree.logprobs)) < 1e-9
        for sid, d in zip(contexts, want.drafts):
            contexts[sid] += d.tree.token_ids[:2] + [step + 11]
    assert fast.graphs.pairs_captured[(2, 32)].graph.replays == 2
