"""Which pre-draft the gateway takes after a verdict (gateway/request.py PreDraft): the main one
only after a whole draft passed and its first token is the bonus; a hedge only for the number of
draft tokens the verdict kept and only when its first token is the verifier's correction. The
scheduler makes the foreseen one the next draft and tells auto whether each pre-draft hit."""

from __future__ import annotations

import pytest

from gateway.request import PreDraft
from specdec.draft_tree import DraftTree


def chain(tokens: list[int]) -> DraftTree:
    return DraftTree.chain(tokens, [0.0] * len(tokens))


def test_the_main_pre_draft_needs_the_whole_draft_and_the_bonus():
    pre = PreDraft(chain([7, 8, 9]))
    assert pre.next_draft(3, 3, 7).token_ids == [8, 9]
    assert pre.next_draft(3, 3, 6) is None           # bonus guessed wrong
    assert pre.next_draft(2, 3, 7) is None           # a rejection, and no hedges
    assert PreDraft(chain([7])).next_draft(3, 3, 7) is None   # nothing after the guess


def test_a_hedge_is_taken_for_its_kept_count_and_correction_only():
    pre = PreDraft(chain([7, 8, 9]), {0: chain([20, 21, 22]), 1: chain([30, 31, 32]), 2: chain([40])})
    assert pre.next_draft(0, 3, 20).token_ids == [21, 22]
    assert pre.next_draft(1, 3, 30).token_ids == [31, 32]
    assert pre.next_draft(1, 3, 20) is None          # hedge 0's guess, but the verdict kept one token
    assert pre.next_draft(0, 3, 21) is None          # correction guessed wrong
    assert pre.next_draft(2, 3, 40) is None          # a guess with no chain after it
    assert pre.next_draft(3, 3, 7).token_ids == [8, 9]
    assert pre.next_draft(3, 3, 20) is None          # whole draft passed: hedges do not apply


def test_hedges_received_as_protobuf_are_converted_only_when_used():
    from specdec.rpc.convert import tree_from_proto, tree_to_proto

    converted = []

    def convert(msg):
        converted.append(list(msg.token_ids))
        return tree_from_proto(msg)

    hedges = {j: tree_to_proto(chain([20 + j, 30 + j, 40 + j])) for j in range(3)}
    assert PreDraft(chain([7, 8]), hedges, convert).next_draft(1, 3, 99) is None
    assert converted == []                                  # guess wrong: nothing converted
    assert PreDraft(chain([7, 8]), hedges, convert).next_draft(1, 3, 21).token_ids == [31, 41]
    assert converted == [[21, 31, 41]]


def test_the_scheduler_takes_a_foreseen_hedge_and_tells_auto_whether_pre_drafts_hit():
    from types import SimpleNamespace

    from test_auto_parking import controller, request

    from gateway.scheduler import Scheduler

    auto = controller(hidden_states=False)
    sched = Scheduler(SimpleNamespace(address="v:1"), 4, set(), auto=auto)
    r = request(0)
    for _ in range(25):   # a draft of 3 tokens; the verdict keeps 1, then the correction 30
        r.draft = chain([5, 6, 7])
        r.predraft = PreDraft(chain([8, 9, 10]), {1: chain([30, 31, 32])})
        sched._count_step(r, [5, 30], 1)
        assert r.draft.token_ids == [31, 32] and r.predraft is None
    r.draft, r.predraft = chain([5, 6, 7]), PreDraft(chain([8, 9, 10]))
    sched._count_step(r, [5, 30], 1)                       # no hedge: a miss, no draft ready
    assert r.draft is None and (r.stats.overlap_hits, r.stats.overlap_misses) == (25, 1)
    hits = sum(0.99 ** i for i in range(1, 26))            # decayed by the miss that came after them
    assert auto.book.predraft_hits.rate(3) == pytest.approx(hits / (hits + 1))
