"""The scheduler sends a step's messages to its backends before the client streams that the last
verdicts woke take their turns on the event loop: at C = 32 those turns cost milliseconds, and a
request sent after them waits that long before its engine starts (scripts/bench_gateway.py
measures it). Stand-in backend streams record, when a step is sent, whether the request's client
side has already taken the tokens of the verdict before it."""

from __future__ import annotations

import asyncio

import pytest

from gateway.request import ActiveRequest, GenerationRequest, Mode, SpecSettings
from gateway.scheduler import Scheduler
from specdec.rpc import common_pb2, drafter_pb2, verifier_pb2
from specdec.sampling import GREEDY

from null_detokenizer import NullDetokenizer

PROMPT = [1, 2, 3]
NEW_TOKENS = 12


class Client:
    """A request's RPC handler: takes its events as soon as the loop lets it."""

    def __init__(self, r: ActiveRequest) -> None:
        self.taken = 0   # tokens received
        self.task = asyncio.get_running_loop().create_task(self._drain(r))

    async def _drain(self, r: ActiveRequest) -> None:
        while True:
            ev = await r.events.get()
            self.taken += len(ev.token_ids)
            if ev.finish_reason:
                return


class Backend:
    """Records, at each send, the tokens committed so far and those the client had taken."""
    address = "stand-in"

    def __init__(self, r: ActiveRequest, client: Client) -> None:
        self.r, self.client, self.sends = r, client, []

    def record(self, role: str) -> None:
        self.sends.append((role, len(self.r.tokens) - len(PROMPT), self.client.taken))

    def reset(self) -> None:
        pass


class Verifier(Backend):
    async def step(self, msg):
        if msg.open or msg.verify:   # (not a message that only closes the finished request)
            self.record("verify")
        await asyncio.sleep(0)   # the engine's time: the loop turns
        resp = verifier_pb2.VerifyStepResponse(step=msg.step)
        for o in msg.open:
            resp.verdicts.add(seq_id=o.seq_id, committed_len=len(o.prompt_ids) + 1, accepted_ids=[7])
        for v in msg.verify:   # the draft's first token passes, then a bonus
            accepted = [*v.draft.token_ids[:1], 7]
            resp.verdicts.add(seq_id=v.seq_id, committed_len=v.committed_len + len(accepted),
                              accepted_ids=accepted, accepted_drafts=len(accepted) - 1)
        return resp


class Drafter(Backend):
    async def step(self, msg):
        if msg.items:
            self.record("draft")
        await asyncio.sleep(0)
        resp = drafter_pb2.DraftStepResponse(step=msg.step)
        for item in msg.items:
            resp.drafts.add(seq_id=item.seq_id, committed_len=item.committed_len,
                            tree=common_pb2.DraftTree(token_ids=[5, 6], parents=[0, 1]))
        return resp


async def serve(mode: Mode) -> list[tuple[str, int, int]]:
    req = GenerationRequest("r", PROMPT, NEW_TOKENS, [], False, SpecSettings(mode, k=2, overlap=False), GREEDY)
    r = ActiveRequest(req=req, seq_id="s0", mode=mode, detok=NullDetokenizer(), sampling=GREEDY,
                      drafter=None if mode == Mode.OFF else Drafter.address)
    client = Client(r)
    verifier, drafter = Verifier(r, client), Drafter(r, client)
    sched = Scheduler(verifier, 4, set())
    sched.drafters[Drafter.address] = drafter
    sched.submit(r)
    task = asyncio.get_running_loop().create_task(sched.run())
    await asyncio.wait_for(client.task, 10)
    task.cancel()
    return sorted(verifier.sends + drafter.sends, key=lambda s: s[1])


@pytest.mark.parametrize("mode", [Mode.OFF, Mode.CHAIN])
def test_a_step_is_sent_before_the_last_verdicts_reach_the_clients(mode):
    sends = asyncio.run(serve(mode))
    after_a_verdict = [s for s in sends if s[1] > 0]
    assert len(after_a_verdict) >= 3
    assert {role for role, _, _ in after_a_verdict} == ({"verify"} if mode == Mode.OFF else {"verify", "draft"})
    first = "verify" if mode == Mode.OFF else "draft"   # a step's first message
    for role, committed, taken in after_a_verdict:
        if role == first:
            assert taken < committed, (role, committed, taken)
