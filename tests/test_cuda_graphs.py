"""CUDA-graph padding, checked on the CPU: the graphed forward pads a batch up to its bucket
(rows writing into the scratch slot) and the query length up to the captured one (tokens that
see only themselves). Here the "graph" is the same eager forward on the padded static inputs, so
every difference from the unpadded forward is the padding's fault: verdicts must be identical,
logits equal to rounding, real KV entries identical, and no other sequence's slot touched.
(tests/test_cuda_graphs_cuda.py replays real graphs on the GPU.)"""

from __future__ import annotations

import random

import torch

from specdec.model.batch import ForwardBatch, causal_region
from specdec.model.cuda_graphs import GraphedForward, _Graph, verify_query_lens, wide_step_tokens
from specdec.model.loader import load_model
from specdec.model.runner import ModelRunner
from specdec.tree import DraftTree
from verifier_svc.engine import VerifierEngine
from verifier_svc.types import OpenSequence, VerifierStep, VerifyItem

SLOTS, CONTEXT, DRAFT = 6, 96, 16


class EagerGraphs(GraphedForward):
    """The graph machinery with replay replaced by an eager forward over the static inputs."""

    def _capture_one(self, b: int, n: int) -> _Graph:
        return self._static(b, n)

    def _replay(self, g: _Graph) -> None:
        self._write_logits(g)


def engines(path, device: str = "cpu", dtype=torch.float64, graphs=EagerGraphs, prefill_chunk: int = 0,
            query_lens=(1, 2, 5, 9), max_draft: int = DRAFT,
            max_tokens: int | None = None) -> tuple[VerifierEngine, VerifierEngine]:
    """Two verifiers of one checkpoint: eager, and graphed with batch buckets 1, 2, 4, 6 and
    query lengths 1, 2, 5, 9 (pairs of at most max_tokens tokens); prompt chunks in buckets of
    1, 2, 4 rows of 4, 8, 16 tokens, at most 32 tokens a graph."""
    out = []
    for graphed in (False, True):
        runner = ModelRunner(load_model(path, dtype, torch.device(device)))
        engine = VerifierEngine(runner, SLOTS, CONTEXT, max_draft, prefill_chunk=prefill_chunk)
        if graphed:
            common = (runner._model_forward, runner.spec.vocab_size, SLOTS, runner.cache.slot_len, runner.device)
            runner.graphs = graphs(*common, (1, 2, 4, SLOTS), query_lens, torch.promote_types(dtype, torch.float32),
                                   max_tokens=max_tokens)
            runner.graphs.capture()
            runner.prefill_graphs = graphs(*common, (1, 2, 4), (4, 8, 16), torch.promote_types(dtype, torch.float32),
                                           last_logit=True, max_tokens=32)
            runner.prefill_graphs.capture()
        out.append(engine)
    return out[0], out[1]


def count_replays(graphs: GraphedForward) -> list:
    """Wrap graphs.run: -> the list of what each call returned (None: it ran eagerly)."""
    replayed, real_run = [], graphs.run
    graphs.run = lambda *args: replayed.append(real_run(*args)) or replayed[-1]
    return replayed


def random_draft(rng: random.Random, vocab: int) -> DraftTree:
    size = rng.choice([0, 1, 3, 4, 7, 8, 12])
    if rng.random() < 0.5:
        return DraftTree.chain([rng.randrange(vocab) for _ in range(size)])
    parents = [rng.randrange(i) for i in range(1, size + 1)]
    return DraftTree([rng.randrange(vocab) for _ in range(size)], parents)


def test_padded_forward_changes_nothing(checkpoints):
    check_padded_steps(*engines(checkpoints["llama-gqa"]), tol=1e-12)


def check_padded_steps(eager: VerifierEngine, graphed: VerifierEngine, tol: float) -> None:
    """Random verify steps of 1..5 sequences and drafts of 0..12 nodes give the same verdicts
    and KV with and without graphs; padding rows write only to the scratch slot."""
    vocab = eager.spec.vocab_size
    rng = random.Random(5)
    replayed = count_replays(graphed.runner.graphs)
    ids = [f"s{i}" for i in range(5)]
    opens = [OpenSequence(sid, [rng.randrange(vocab) for _ in range(rng.randint(2, 9))]) for sid in ids]
    assert eager.step(VerifierStep(0, open=opens)) == graphed.step(VerifierStep(0, open=opens))
    used = set()
    for step in range(1, 12):
        live = rng.sample(ids, rng.randint(1, 5))  # batches of 1..5: padded to 1, 2, 4 or 6 rows
        items = [VerifyItem(sid, len(eager.table.get(sid).tokens), random_draft(rng, vocab)) for sid in live]
        expected, got = eager.step(VerifierStep(step, verify=items)), graphed.step(VerifierStep(step, verify=items))
        assert not expected.errors and got == expected, f"step {step}"
        used |= {(len(live), 1 + max(len(it.draft) for it in items))}
    assert len(used) > 5  # several bucket/length pairs, padded both ways
    assert sum(r is not None for r in replayed) > 5 and None in replayed  # graphed, and eager past 9 nodes
    for sid in ids:  # the KV entries the sequences own are the same
        e, g = eager.table.get(sid), graphed.table.get(sid)
        n = len(e.tokens) - 1
        for cache_e, cache_g in ((eager.runner.cache.k, graphed.runner.cache.k),
                                 (eager.runner.cache.v, graphed.runner.cache.v)):
            torch.testing.assert_close(cache_g[:, g.slot, :n], cache_e[:, e.slot, :n], rtol=tol, atol=tol)
    free = [s for s in range(SLOTS) if s not in {graphed.table.get(sid).slot for sid in ids}]
    assert not graphed.runner.cache.k[:, free].any()  # padding rows write only to the scratch slot
    assert graphed.runner.cache.k[:, SLOTS].any()


def test_wide_trees_replay_where_their_tokens_fit(checkpoints):
    check_wide_trees(*wide_engines(checkpoints["llama-gqa"], "cpu", torch.float64, EagerGraphs), tol=1e-12)


def wide_engines(path, device: str, dtype: torch.dtype, graphs) -> tuple[VerifierEngine, VerifierEngine]:
    """The verifiers' graph lengths for drafts of up to 64 nodes, capped as the services cap them."""
    return engines(path, device, dtype, graphs, query_lens=verify_query_lens(64), max_draft=64,
                   max_tokens=wide_step_tokens(SLOTS))


def check_wide_trees(eager: VerifierEngine, graphed: VerifierEngine, tol: float) -> None:
    """Trees of 17..64 nodes: one or two sequences replay the 33- and 65-token graphs (within
    6 rows x 17 tokens), three run eagerly; verdicts and KV equal the eager engine's."""
    graphs = graphed.runner.graphs
    assert {(1, 65), (2, 33)} <= graphs.graphs.keys() and not {(2, 65), (4, 33)} & graphs.graphs.keys()
    assert graphs.logits.numel() == SLOTS * 17 * eager.spec.vocab_size   # no larger than without wide trees
    vocab, rng = eager.spec.vocab_size, random.Random(9)
    replayed = count_replays(graphs)
    ids = ["w0", "w1", "w2"]
    opens = [OpenSequence(sid, [rng.randrange(vocab) for _ in range(5)]) for sid in ids]
    assert eager.step(VerifierStep(0, open=opens)) == graphed.step(VerifierStep(0, open=opens))
    # nodes per sequence each step -> the graph (rows, query length) it replays: (1, 65), (2, 33),
    # none (3 rows of up to 41 tokens: eager), (1, 33), (1, 65)
    plan = ({"w0": 64}, {"w0": 30, "w1": 32}, {"w0": 20, "w1": 25, "w2": 40}, {"w1": 17}, {"w2": 48})
    for step, sizes in enumerate(plan, start=1):
        items = []
        for sid, size in sizes.items():
            tokens = [rng.randrange(vocab) for _ in range(size)]
            items.append(VerifyItem(sid, len(eager.table.get(sid).tokens),
                                    DraftTree(tokens, [rng.randrange(i) for i in range(1, size + 1)])))
        want, got = eager.step(VerifierStep(step, verify=items)), graphed.step(VerifierStep(step, verify=items))
        assert not want.errors and got == want, f"step {step}"
    assert [r is None for r in replayed] == [False, False, True, False, False]
    for sid in ids:
        e, g = eager.table.get(sid), graphed.table.get(sid)
        n = len(e.tokens) - 1
        torch.testing.assert_close(graphed.runner.cache.k[:, g.slot, :n], eager.runner.cache.k[:, e.slot, :n],
                                   rtol=tol, atol=tol)


def test_padded_prefill_changes_nothing(checkpoints):
    """Prompts of 1..30 tokens opened a few at a time, whole and in chunks of 12 tokens a step:
    the prefill graphs (rows padded to 1, 2, 4, tokens to 4, 8, 16; past 32 padded tokens, eager)
    give the same first tokens and KV entries as the eager prefill, the next verify steps agree,
    and padding writes into no slot that a sequence owns."""
    check_padded_prefill(checkpoints["llama-gqa"], "cpu", torch.float64, EagerGraphs, tol=1e-12)


def check_padded_prefill(path, device: str, dtype: torch.dtype, graphs, tol: float) -> None:
    for chunk in (0, 12):
        eager, graphed = engines(path, device, dtype, graphs, prefill_chunk=chunk)
        replayed = count_replays(graphed.runner.prefill_graphs)
        vocab, rng = eager.spec.vocab_size, random.Random(chunk)
        ids = [f"p{i}" for i in range(SLOTS)]
        groups = [{ids[0]: 7}, {ids[1]: 3, ids[2]: 16}, {ids[3]: 1, ids[4]: 9, ids[5]: 30}]  # prompt lengths
        for step, group in enumerate(groups):
            opens = [OpenSequence(sid, [rng.randrange(vocab) for _ in range(n)]) for sid, n in group.items()]
            want = eager.step(VerifierStep(step, open=opens)).verdicts + eager.finish_prefills()
            got = graphed.step(VerifierStep(step, open=opens)).verdicts + graphed.finish_prefills()
            assert got == want and len(got) == len(group), f"chunk {chunk}, step {step}"
        for step in range(3, 6):
            items = [VerifyItem(sid, len(eager.table.get(sid).tokens), random_draft(rng, vocab)) for sid in ids]
            assert graphed.step(VerifierStep(step, verify=items)) == eager.step(VerifierStep(step, verify=items))
        assert sum(r is not None for r in replayed) >= 2 and None in replayed, chunk  # graphed, and eager past 32
        for sid in ids:
            e, g = eager.table.get(sid), graphed.table.get(sid)
            n = len(e.tokens) - 1
            torch.testing.assert_close(graphed.runner.cache.k[:, g.slot, :n], eager.runner.cache.k[:, e.slot, :n],
                                       rtol=tol, atol=tol)


def test_padded_tokens_stay_in_their_slot():
    """A row's padded tokens write their KV into its slot's last position, which the engines keep
    free for padding, never past its real tokens: that can be another row's (next test)."""
    seen = []
    graphs = EagerGraphs(lambda batch, index: seen.append(batch.write_pos.clone()) or torch.zeros(1, 1, 8),
                         8, 2, 20, torch.device("cpu"), (1,), (4, 8), last_logit=True)
    graphs.capture()
    pos = torch.tensor([[15, 16, 17]])
    batch = ForwardBatch.build(torch.zeros(1, 3, dtype=torch.long), pos, torch.tensor([0]), pos, torch.tensor([15]),
                               causal_region(torch.tensor([3]), 3), kv_len=18)
    assert graphs.run(batch, torch.tensor([[2]])) is not None
    assert seen[-1].tolist() == [[15, 16, 17, 19]]
    pos = torch.tensor([[4, 5, 6, 7, 8]])  # five tokens padded to eight
    batch = ForwardBatch.build(torch.zeros(1, 5, dtype=torch.long), pos, torch.tensor([0]), pos, torch.tensor([4]),
                               causal_region(torch.tensor([5]), 5), kv_len=9)
    graphs.run(batch, torch.tensor([[4]]))
    assert seen[-1].tolist() == [[4, 5, 6, 7, 8, 19, 19, 19]]


def test_padded_tokens_never_write_where_another_row_of_the_forward_does():
    """With --fold-prefill a prompt rides in a verify forward as consecutive rows of one slot. Its
    first row padded to the graph's length must not write where its second row's real tokens do
    (on the GPU the writes race: the fold test's verdicts differed from the eager engine's)."""
    seen = []
    graphs = EagerGraphs(lambda batch: seen.append((batch.slots.clone(), batch.write_pos.clone()))
                         or torch.zeros(2, 5, 8), 8, 3, 40, torch.device("cpu"), (2,), (5,))
    graphs.capture()
    pos = torch.tensor([[10, 11, 12], [13, 14, 15]])   # one prompt's tokens 10..15 in rows of 3, slot 1
    batch = ForwardBatch.build(torch.zeros(2, 3, dtype=torch.long), pos, torch.tensor([1, 1]), pos,
                               torch.tensor([10, 13]), causal_region(torch.tensor([3, 3]), 3), kv_len=16)
    assert graphs.run(batch) is not None
    slots, write_pos = seen[-1]
    real = {(1, p) for p in range(10, 16)}
    pads = {(int(slots[r]), int(write_pos[r, c])) for r in range(2) for c in range(3, 5)}
    assert pads and not pads & real, sorted(pads & real)


def test_logits_equal_unpadded_and_odd_shapes_fall_back(checkpoints):
    check_logits(*engines(checkpoints["qwen2-bias"]), tol=1e-10)


def check_logits(eager: VerifierEngine, graphed: VerifierEngine, tol: float) -> None:
    prompt = [3, 1, 4, 1, 5]
    for engine in (eager, graphed):
        engine.step(VerifierStep(0, open=[OpenSequence("a", prompt), OpenSequence("b", prompt[:3])]))
    def chain_batch(engine, n):
        dev = engine.device
        starts = torch.tensor([len(engine.table.get(s).tokens) - 1 for s in "ab"], device=dev)
        tok = torch.tensor([[7] * n, [9] * n], device=dev)
        pos = starts[:, None] + torch.arange(n, device=dev)
        return ForwardBatch.build(tok, pos, engine.table.slots([engine.table.get(s) for s in "ab"], dev),
                                  pos, starts, causal_region(torch.tensor([n, n], device=dev), n))

    for n in (1, 3, 9):
        want = eager.runner.forward(chain_batch(eager, n))
        got = graphed.runner.forward(chain_batch(graphed, n))
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert graphed.runner.graphs.run(chain_batch(graphed, 10)) is None  # longer than any capture: eager


def test_packed_inputs_arrive_whole_and_padded():
    """A step's small int64 inputs move in one copy: upload_packed gives back each part, shape and
    values; a graph's PackedStatics hold their capture values until loaded, then exactly the parts
    (padding rows with those capture values)."""
    from specdec.model.batch import PackedStatics, upload_packed

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    parts = [torch.arange(6).view(2, 3), torch.tensor([7, -1]), torch.tensor([[5], [6]])]
    for got, want in zip(upload_packed(parts, dev), parts):
        assert got.shape == want.shape and torch.equal(got.cpu(), want)
    statics = PackedStatics([((4, 3), 0), ((4,), 9), ((4, 1), -1)], dev)
    assert [v.cpu().unique().tolist() for v in statics.views] == [[0], [9], [-1]]
    statics.load(parts)
    tokens, slots, forced = (v.cpu() for v in statics.views)
    assert tokens.tolist() == [[0, 1, 2], [3, 4, 5], [0, 0, 0], [0, 0, 0]]
    assert slots.tolist() == [7, -1, 9, 9] and forced.tolist() == [[5], [6], [-1], [-1]]
