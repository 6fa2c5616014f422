"""Waiting prompts join a large running batch in groups (gateway/admission.py): a step that takes in
prompts pays a fixed cost however many it takes. The rule alone, then a scheduler driven step by step
over a stand-in verifier (mode off: one token a step)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from gateway.admission import AT_ONCE, AdmissionPolicy
from gateway.request import ActiveRequest, GenerationRequest, Mode, SpecSettings
from gateway.scheduler import Scheduler
from specdec.rpc import verifier_pb2
from specdec.sampling import GREEDY

from null_detokenizer import NullDetokenizer

GROUPED = AdmissionPolicy(fraction=0.125, max_wait_steps=4)


def test_a_small_batch_admits_a_prompt_at_once():
    assert GROUPED.due(waiting=1, oldest_wait_steps=1, running=7)   # 1 >= 0.125 x 7
    assert GROUPED.due(waiting=1, oldest_wait_steps=1, running=0)   # nothing running: nothing to group with


def test_a_large_batch_admits_once_the_prompts_are_a_share_of_it_or_the_oldest_waited_long_enough():
    assert not GROUPED.due(waiting=1, oldest_wait_steps=1, running=64)
    assert not GROUPED.due(waiting=7, oldest_wait_steps=3, running=64)
    assert GROUPED.due(waiting=8, oldest_wait_steps=1, running=64)
    assert GROUPED.due(waiting=1, oldest_wait_steps=4, running=64)
    assert not GROUPED.due(waiting=0, oldest_wait_steps=9, running=64)


def test_without_a_wait_every_prompt_joins_the_next_step():
    assert AT_ONCE.due(waiting=1, oldest_wait_steps=1, running=64)
    assert AdmissionPolicy(fraction=0.5, max_wait_steps=0).due(waiting=1, oldest_wait_steps=1, running=64)


class Verifier:
    """Mode off: each open gets its first token once its prefill's steps have run, each verify one more;
    records what each step opened."""
    address = "stand-in"

    def __init__(self, prefill_steps: int = 1) -> None:
        self.opened: list[list[str]] = []   # per step: the seq ids it admitted
        self.prefill_steps = prefill_steps  # a prompt prefills in chunks over this many steps
        self.prefilling: dict[str, tuple[int, int]] = {}   # seq id -> (steps left, prompt length)

    async def step(self, msg):
        self.opened.append([o.seq_id for o in msg.open])
        resp = verifier_pb2.VerifyStepResponse(step=msg.step, engine_seconds=0.002)
        self.prefilling.update({o.seq_id: (self.prefill_steps, len(o.prompt_ids)) for o in msg.open})
        for seq_id, (left, length) in list(self.prefilling.items()):
            self.prefilling[seq_id] = (left - 1, length)
            if left == 1:
                del self.prefilling[seq_id]
                resp.verdicts.add(seq_id=seq_id, committed_len=length + 1, accepted_ids=[7])
        for v in msg.verify:
            resp.verdicts.add(seq_id=v.seq_id, committed_len=v.committed_len + 1, accepted_ids=[7])
        return resp

    def reset(self) -> None:
        pass


def request(i: int) -> ActiveRequest:
    req = GenerationRequest(f"r{i}", [1, 2, 3], 1000, [], False, SpecSettings(Mode.OFF), GREEDY)
    return ActiveRequest(req=req, seq_id=f"s{i}", mode=Mode.OFF, detok=NullDetokenizer(), sampling=GREEDY)


class Log:
    """Records the scheduler's debug lines as a log file would show them."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def debug(self, event: str, **kw) -> None:
        self.lines.append(f"... [debug ] {event} " + " ".join(f"{k}={v}" for k, v in kw.items()))

    info = warning = error = debug


class Auto:
    """Stands in for `--mode auto`'s controller (the requests here run mode off): records the steps
    the scheduler reports."""
    hidden_states = False
    holding: set = set()

    def __init__(self) -> None:
        self.steps: list[tuple[int, int, int]] = []   # (step number, prompts admitted, batch after them)
        self.carried: list[int] = []                  # prompts that earlier steps admitted, still prefilling
        self.releases: list[int] = []                 # steps that ran requests off to release held rows

    def plan(self, continuing, prefilling) -> None:
        pass

    def take_parked(self) -> list:
        return []

    def observe_step(self, seconds, draft_seconds, prefilling, admitted, active, carried) -> None:
        self.steps.append((self.sched.step_no, admitted, active))
        self.carried.append(carried)

    def observe_release(self, seconds) -> None:
        self.releases.append(self.sched.step_no)

    def observe_verdict(self, *args) -> None:
        pass

    def forget(self, r, ended: bool = True) -> None:
        pass


async def admitted_at(admission: AdmissionPolicy, running: int, arrivals: dict[int, int], steps: int,
                      log: Log | None = None, auto: Auto | None = None, prefill_steps: int = 1) -> dict[str, int]:
    """`running` requests in the batch, then `arrivals[t]` prompts submitted before step t (counted from
    1 after the batch is running); -> each new prompt's seq id -> the step that admitted it."""
    verifier = Verifier(prefill_steps)
    sched = Scheduler(verifier, 128, set(), admission=admission, auto=auto)
    if auto is not None:
        auto.sched = sched
    if log is not None:
        sched.log = log
    for i in range(running):
        sched.submit(request(i))
    await sched._step()   # all admitted at once: nothing was running
    assert len(verifier.opened[-1]) == running
    n = running
    at: dict[str, int] = {}
    for t in range(1, steps + 1):
        for _ in range(arrivals.get(t, 0)):
            sched.submit(request(n))
            n += 1
        await sched._step()
        at.update({sid: t for sid in verifier.opened[-1]})
    return at


def test_the_scheduler_holds_a_lone_prompt_back_at_most_max_wait_steps_beside_a_large_batch():
    at = asyncio.run(admitted_at(GROUPED, running=64, arrivals={1: 1, 2: 1, 3: 1}, steps=8))
    assert at == {"s64": 4, "s65": 4, "s66": 4}   # one step takes in the three, when the first has waited 4


def test_the_scheduler_admits_a_group_of_a_batchs_share_at_once():
    at = asyncio.run(admitted_at(GROUPED, running=64, arrivals={2: 8}, steps=4))
    assert set(at.values()) == {2} and len(at) == 8


def test_the_scheduler_admits_at_once_beside_a_small_batch_or_without_grouping():
    assert asyncio.run(admitted_at(GROUPED, running=4, arrivals={1: 1, 2: 1}, steps=3)) == {"s4": 1, "s5": 2}
    assert asyncio.run(admitted_at(AT_ONCE, running=64, arrivals={1: 1, 2: 1}, steps=3)) == {"s64": 1, "s65": 2}


def test_each_steps_line_says_what_it_did_and_the_log_summary_sums_them_by_kind():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from auto_log_summary import step_kinds

    log = Log()
    asyncio.run(admitted_at(GROUPED, running=64, arrivals={1: 1, 2: 1}, steps=6, log=log))
    kinds = step_kinds(log.lines)
    assert {k: v.steps for k, v in kinds.items()} == {"admitting a wave": 1, "admitting prompts": 1, "off": 5}
    assert kinds["admitting prompts"].batch == 64 and kinds["off"].batch == 64 * 3 + 66 * 2
    # the tokens each step committed: one a running request, and each prompt's first
    assert kinds["admitting prompts"].committed == 64 + 2 and kinds["off"].committed == 64 * 3 + 66 * 2
    # the engines' share of the round trips (the stand-in verifier says its engine took 2 ms a step)
    assert kinds["off"].round_trips["verify_engine_ms"] == pytest.approx(kinds["off"].steps * 2.0)


def test_the_scheduler_tells_auto_what_each_step_took_in_and_the_batch_it_joined():
    """Auto charges a step's excess to the prompts it admitted, at the batch they join (StepOverheads):
    the scheduler reports every step that ran requests or took in prompts, a wave into an empty
    batch included (clients that mode off keeps in lockstep admit nothing else)."""
    auto = Auto()
    asyncio.run(admitted_at(AT_ONCE, running=8, arrivals={1: 2, 3: 10}, steps=4, auto=auto))
    assert auto.steps == [(1, 8, 8), (2, 2, 10), (3, 0, 10), (4, 10, 20), (5, 0, 20)]
    assert auto.carried == [0] * 5   # each prompt prefilled in the step that admitted it


def test_the_scheduler_tells_auto_how_many_earlier_prompts_a_step_still_prefilled():
    """Prompts that prefill in chunks over two steps: a step that admits more also prefills those of the
    step before, and auto shares its excess among both groups (StepOverheads)."""
    auto = Auto()
    asyncio.run(admitted_at(AT_ONCE, running=8, arrivals={1: 2, 2: 3}, steps=4, auto=auto, prefill_steps=2))
    assert auto.steps == [(1, 8, 8), (2, 2, 10), (3, 3, 13), (4, 0, 13), (5, 0, 13)]
    assert auto.carried == [0, 8, 2, 3, 0]


def test_a_step_that_releases_held_rows_is_reported_as_a_release_not_as_a_choices_step():
    """A step that runs requests off against the plan while their held hidden states travel measures no
    choice, but it is part of a switch's price, which auto charges to the kind switched to (RealizedRates)."""
    auto = Auto()
    auto.hidden_states = True
    sched = Scheduler(Verifier(), 128, set(), auto=auto)
    auto.sched = sched
    sched._hold_or_release = lambda continuing: sched.step_no == 3
    for i in range(4):
        sched.submit(request(i))
    for _ in range(4):
        asyncio.run(sched._step())
    assert auto.releases == [3]
    assert [step for step, *_ in auto.steps] == [1, 2, 4]


def test_the_scheduler_learns_a_hidden_state_rows_size_from_the_verdicts():
    """The budget for releasing held rows counts bytes (gateway/release_budget.py): the scheduler reads a
    row's size off the verdicts' payloads."""
    class RowsVerifier(Verifier):
        async def step(self, msg):
            resp = await super().step(msg)
            for v in resp.verdicts:
                v.hidden_states.dtype, v.hidden_states.data = "uint8", bytes(24)
                v.hidden_states.shape[:] = [2, 12]
            return resp

    sched = Scheduler(RowsVerifier(), 8, set())
    assert sched.release_budget.step_rows() is None
    sched.submit(request(0))
    asyncio.run(sched._step())
    assert sched.release_budget.row_bytes == 12


def test_the_log_summary_keeps_each_modes_steps_apart():
    """A sweep runs one mode at a time through one gateway: the summary splits its steps by the mode of
    the requests started last and how many started in a row."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from auto_log_summary import by_mode, step_kinds

    def started(mode):
        return f"... [info ] request started drafter=d max_new_tokens=64 mode={mode} n=1 request_id=r"

    def step(admitted, drafting, prefilling=False):
        return (f"... [debug ] scheduler step admitted={admitted} batch=4 draft_ms=1 drafting={drafting} ms=10 "
                f"predraft_ms=0 predrafting=0 prefilling={prefilling} released=False verify_ms=9")

    lines = [started("off"), started("off"), step(2, 0, True), step(0, 0, True), step(0, 0),
             started("chain"), started("chain"), step(0, 4), step(0, 4), step(0, 4),
             started("off"), started("off"), step(0, 0)]
    blocks = by_mode(lines)
    assert set(blocks) == {"off x 2", "chain x 2"}
    assert {k: v.steps for k, v in step_kinds(blocks["off x 2"]).items()} == {
        "admitting prompts": 1, "prefilling earlier prompts": 1, "off": 2}
    assert {k: v.steps for k, v in step_kinds(blocks["chain x 2"]).items()} == {"speculating": 3}
