"""The step loop of one verifier replica: all its active requests advance together.

Each step: admit waiting requests (the verifier prefills them), get drafts for sequences that
have none (synchronously, from each request's pinned drafter replica), then send one batched
verify step; in chain mode with overlap the drafters pre-draft step t+1 at the same time,
assuming the draft under verification passes. A pre-draft is used only if the verdict accepted
the whole draft and the bonus token equals the pre-draft's first token, or, from a drafter that
hedges, if one of its hedges foresaw the verdict's accepted count and correction token; otherwise
it is dropped.
Losing a drafter turns its requests into plain decoding (same tokens, lossless); losing the
verifier fails this scheduler's requests with UNAVAILABLE. Requests in `--mode auto` get their
shape for each step from gateway/auto/ (which learns from the verdicts and the step's time), and
each step's counts and time split go to the metrics (gateway/metrics.py).
"""

from __future__ import annotations

import asyncio
import uuid
import time
from collections import defaultdict, deque
from collections.abc import Awaitable, Callable

import structlog

from gateway import metrics
from gateway.admission import AT_ONCE, AdmissionPolicy
from gateway.auto.controller import AutoController, draft_family
from gateway.backends import BackendLost, StepStream
from gateway.dialer import BackendDialer
from gateway.hold import NO_HOLD, POLL_SECONDS, HoldGate
from gateway.release_budget import ReleaseBudget
from gateway.request import ActiveRequest, Event, Mode, PreDraft
from specdec.errors import ErrorCode
from specdec.rpc import common_pb2, drafter_pb2, verifier_pb2
from specdec.rpc.convert import error_from_proto, sampling_to_proto, tree_from_proto, tree_to_proto


class Scheduler:
    def __init__(self, verifier: StepStream, max_sequences: int, eos_ids: set[int],
                 on_done: Callable[[ActiveRequest], None] = lambda r: None,
                 on_lost: Callable[[str, str], None] = lambda role, address: None,
                 hold: HoldGate = NO_HOLD, auto: AutoController | None = None,
                 dialer: BackendDialer | None = None,
                 on_orphans: Callable[[list[ActiveRequest]], None] | None = None,
                 admission: AdmissionPolicy = AT_ONCE) -> None:
        self.verifier = verifier
        self.admission = admission  # when waiting prompts join the running batch
        self.dialer = dialer or BackendDialer()   # opens the streams to drafter replicas
        self.auto = auto            # `--mode auto`: plans each step's speculation, learns costs
        self.max_sequences = max_sequences
        self.eos_ids = eos_ids
        self.on_done = on_done      # a request left this scheduler (router bookkeeping)
        self.on_lost = on_lost      # a backend stream broke (router marks the replica down)
        self.on_orphans = on_orphans  # the verifier was lost: these requests resume elsewhere (None: they fail)
        self.hold = hold            # test-only: requests held at a token count
        self.drafters: dict[str, StepStream] = {}  # this scheduler's stream to each drafter replica
        self.pending: deque[ActiveRequest] = deque()
        self.active: dict[str, ActiveRequest] = {}
        self.close_verifier: list[str] = []
        self.close_drafter: dict[str, list[str]] = defaultdict(list)
        self.stop_hidden: list[str] = []   # seq ids whose verdicts should stop carrying hidden states
        self.release_budget = ReleaseBudget()   # how many held hidden-state rows a step may release
        self.held_back: set[str] = set()        # this step: releases put off to a later step (budget)
        self.wakeup = asyncio.Event()
        self.step_no = 0
        self.tally = metrics.StepTally(verifier.address)
        self.log = structlog.get_logger(service="gateway", verifier=verifier.address)

    @property
    def load(self) -> int:
        return len(self.active) + len(self.pending)

    # ---- called by the router ----------------------------------------------------------------
    def submit(self, r: ActiveRequest) -> None:
        if r.drafter is None or (r.auto and self.auto is None):
            r.mode, r.auto = Mode.OFF, False
        r.queued_at_step = self.step_no
        self.pending.append(r)
        self.wakeup.set()

    def cancel(self, r: ActiveRequest) -> None:
        r.cancelled = True
        self.wakeup.set()

    # ---- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            if not self._has_work():
                self.wakeup.clear()
                if self.active:  # all held (test hook): look at the hold files again soon
                    await wait_at_most(self.wakeup, POLL_SECONDS)
                else:
                    await self.wakeup.wait()
                continue
            try:
                await self._step()
            except BackendLost as exc:
                self.verifier.reset()
                if exc.failed:   # the verifier is up but failed the step: retrying would fail again
                    self.log.error("verifier step failed; failing the step's requests", error=str(exc))
                    self._fail_all("INTERNAL", f"the verifier failed the step: {exc}")
                    continue
                self.on_lost("verifier", self.verifier.address)
                if self.on_orphans is None:
                    self.log.error("verifier lost; failing its requests", error=str(exc))
                    self._fail_all("UNAVAILABLE", f"the verifier became unavailable: {exc}")
                else:
                    self.log.error("verifier lost; its requests resume on another", error=str(exc))
                    self.on_orphans(self._release_all())
            except Exception as exc:  # a bug: fail loudly, keep serving
                self.log.exception("step failed")
                self.verifier.reset()
                self._fail_all("INTERNAL", f"internal error in the gateway step loop: {exc}")

    def _has_work(self) -> bool:
        room = len(self.active) < self.max_sequences
        return bool((self.pending and room) or self.close_verifier or any(self.close_drafter.values())
                    or any(r.cancelled or r.opening or not self.hold.held(r) for r in self.active.values()))

    async def _step(self) -> None:
        self.step_no += 1
        t0 = time.perf_counter()
        for r in [r for r in self.active.values() if r.cancelled]:
            self.log.info("request cancelled", request_id=r.req.request_id)
            self._retire(r)
        carried = sum(1 for r in self.active.values() if r.opening)   # admitted before, still prefilling
        opens = self._admit()
        opened = {r.seq_id for r in opens}
        # Still prefilling (the verifier prefills long prompts in chunks): no verdict yet, nothing to verify.
        prefilling = bool(carried or opens)
        continuing = [r for r in self.active.values() if not r.opening and not self.hold.held(r)]
        released = False
        if self.auto is not None:
            self.auto.plan(continuing, prefilling)
            for r in self.auto.take_parked():
                self._park(r)
            released = self.auto.hidden_states and self._hold_or_release(continuing)
        started = time.perf_counter()
        self.tally.queue.set(len(self.pending))
        self.tally.active.set(len(self.active))
        need = [r for r in continuing if r.mode != Mode.OFF and r.draft is None]
        draft = (0.0, 0.0)
        if need:
            draft = await self._draft_all(need, predraft=False)

        verify_msg = verifier_pb2.VerifyStepRequest(
            step=self.step_no,
            open=[verifier_pb2.OpenSequence(
                seq_id=r.seq_id, prompt_ids=r.tokens, sampling=sampling_to_proto(r.sampling),
                share_prefill_with=r.prefill_leader if r.prefill_leader in opened else "",
                want_hidden_states=r.speculates) for r in opens],
            # (no draft: the field left unset, an empty tree to the verifier, built for no request)
            verify=[verifier_pb2.VerifyItem(seq_id=r.seq_id, committed_len=len(r.tokens),
                                            draft=tree_to_proto(r.draft) if r.draft else None) for r in continuing],
            close=self.close_verifier,
            stop_hidden_states=self.stop_hidden,
            hold_hidden_states=self._held_ids(),
        )
        self.close_verifier, self.stop_hidden = [], []
        overlap = [r for r in continuing if r.mode == Mode.CHAIN and r.settings.overlap and r.draft]
        # The verify is awaited here, not gathered: its message leaves now, before the client
        # streams that the last verdicts woke take their turns (a task would start after them).
        predrafts = (asyncio.ensure_future(self._draft_all(overlap, predraft=True))
                     if overlap or any(self.close_drafter.values()) else None)
        verdicts, verify_rtt = await timed(self.verifier.step(verify_msg))
        predraft = await predrafts if predrafts is not None else (0.0, 0.0)
        waited = time.perf_counter() - started   # for the drafts, then the verify (and pre-drafts)
        committed = self._apply_verdicts(verdicts)
        if self.auto is not None and released:
            self.auto.observe_release(time.perf_counter() - started)
        elif self.auto is not None and (continuing or opens or prefilling):
            # The whole step after the plan: what the gateway does per step for a choice (draft
            # messages, tree packing, verdicts, emission) counts as much as the services' time.
            self.auto.observe_step(time.perf_counter() - started, draft[0], prefilling, len(opens),
                                   len(self.active), carried)
        # Where a step's time went, one line a step (SPECDEC_LOG_LEVEL=debug; scripts/auto_log_summary.py
        # sums them by what the step did).
        self.log.debug("scheduler step", step=self.step_no, batch=len(continuing), admitted=len(opens),
                       drafting=len(need), predrafting=len(overlap), prefilling=prefilling, released=released,
                       committed=committed, ms=round((time.perf_counter() - t0) * 1e3, 2),
                       draft_ms=round(draft[0] * 1e3, 2),
                       draft_engine_ms=round(draft[1] * 1e3, 2), verify_ms=round(verify_rtt * 1e3, 2),
                       verify_engine_ms=round(verdicts.engine_seconds * 1e3, 2),
                       predraft_ms=round(predraft[0] * 1e3, 2))
        self.tally.flush(time.perf_counter() - t0, waited, (verify_rtt, verdicts.engine_seconds), draft,
                         predraft[0])

    def _hold_or_release(self, continuing: list[ActiveRequest]) -> bool:
        """The verifier keeps the hidden states of the requests auto runs off (AutoController.holding)
        and sends them with the next verdict of a step that does not hold them. A request planned
        to draft while its rows are held runs off this step instead, and drafts from the next. A
        step releases at most the budget's rows (the rest stay held a step longer), and a request
        holding more than a request may is parked (gateway/release_budget.py).
        -> whether a request ran off against the plan (the step then ran another plan than auto's:
        not measured)."""
        released = False
        step_rows, request_rows = self.release_budget.step_rows(), self.release_budget.request_rows()
        releasing = 0
        self.held_back = set()
        for r in continuing:
            held = r.drafter_lag   # the rows the verifier may hold for r, at most
            if r.rows_held and request_rows is not None and held > request_rows:
                self.auto.park([r])   # its rows stay held this step; the next one stops them
                self.held_back.add(r.seq_id)
                r.rows_held, released = False, True
            elif r.seq_id in self.auto.holding:
                r.rows_held = True
            elif r.rows_held and step_rows is not None and releasing and releasing + held > step_rows:
                self.held_back.add(r.seq_id)   # released by a later step
                r.mode, r.choice, released = Mode.OFF, "off", True
            elif r.rows_held:
                releasing += held
                r.rows_held = False   # this step's verdict brings them
                if r.mode != Mode.OFF and r.draft is None:
                    r.mode, r.choice, released = Mode.OFF, "off", True
        return released

    def _held_ids(self) -> list[str]:
        """Seq ids whose hidden states the verifier keeps this step: the ones auto runs off, and
        prompts admitted while it does, until their prefill's verdict."""
        if self.auto is None or not self.auto.hidden_states:   # (no EAGLE-3 drafter: nothing to hold)
            return []
        opening = {r.seq_id for r in self.active.values() if r.opening and r.rows_held}
        return sorted(self.auto.holding | self.held_back | opening)

    def _admit(self) -> list[ActiveRequest]:
        if not self.pending:
            return []
        running = sum(1 for r in self.active.values() if not (r.cancelled or r.opening or self.hold.held(r)))
        if not self.admission.due(len(self.pending), self.step_no - self.pending[0].queued_at_step, running):
            return []   # grouped with later arrivals (gateway/admission.py)
        opens = []
        batch = min(self.max_sequences, len(self.active) + len(self.pending))   # after this step's admissions
        while self.pending and len(self.active) < self.max_sequences:
            r = self.pending.popleft()
            if r.cancelled:
                self.on_done(r)
                continue
            if not r.tokens:   # (a request resumed from a lost verifier keeps its committed tokens)
                r.tokens = list(r.req.prompt_ids)
            r.opening = True
            if r.auto and self.auto is not None:
                self.auto.admit(r, batch)
                r.rows_held = r.speculates and not r.scout and self.auto.holds_admissions(batch)
            self.active[r.seq_id] = r
            opens.append(r)
        return opens

    # ---- drafting ----------------------------------------------------------------------------
    async def _draft_all(self, reqs: list[ActiveRequest], predraft: bool) -> tuple[float, float]:
        """One draft step on every drafter replica that has work (or closes) pending, concurrently;
        -> (round trip, engine seconds) of the slowest replica."""
        groups: dict[str, list[ActiveRequest]] = defaultdict(list)
        for r in reqs:
            groups[r.drafter].append(r)
        for address, closes in self.close_drafter.items():
            if closes:
                groups.setdefault(address, [])
        if len(groups) == 1:   # awaited here (see _step): the message leaves before the loop turns
            (address, group), = groups.items()
            return await self._draft(address, group, predraft)
        times = await asyncio.gather(*(self._draft(address, group, predraft) for address, group in groups.items()))
        return max(times, default=(0.0, 0.0))

    async def _draft(self, address: str, reqs: list[ActiveRequest], predraft: bool) -> tuple[float, float]:
        # Items are filled in place: a message passed to a constructor is copied, hidden states and all.
        msg = drafter_pb2.DraftStepRequest(step=self.step_no * 2 + int(predraft),
                                           close=self.close_drafter.pop(address, []))
        for r in reqs:
            spec = r.settings
            item = msg.items.add(seq_id=r.seq_id, committed_len=len(r.tokens), append_ids=r.tokens[r.drafter_len:],
                                 sampling=sampling_to_proto(r.sampling))
            if predraft:  # draft after the in-flight draft; one extra token guesses the bonus
                item.assumed_ids.extend(r.draft.token_ids)
                item.chain.k = spec.k + 1
            elif r.mode == Mode.TREE:
                item.tree.topk, item.tree.depth, item.tree.budget = spec.topk, spec.depth, spec.budget
            else:
                item.chain.k = spec.k
            if r.hidden_rows:  # the verifier's states of exactly the appended tokens' predecessors
                concat_payloads(r.hidden_rows, item.hidden_states)
                r.hidden_rows = []
            r.drafter_len = len(r.tokens)
        stream = self.drafters.get(address) or self.drafters.setdefault(
            address, StepStream("drafter", address, self.dialer))
        try:
            resp, rtt = await timed(stream.step(msg))
        except BackendLost as exc:
            self._drafter_lost(address, str(exc))
            return 0.0, 0.0
        by_id = {r.seq_id: r for r in reqs}
        for err in map(error_from_proto, resp.errors):
            r = by_id.get(err.seq_id)
            if r is not None:
                self.log.warning("drafter refused a sequence; it continues without drafts",
                                 request_id=r.req.request_id, code=err.code.name, error=err.message)
                self._stop_speculating(r)
        for d in resp.drafts:
            r = by_id.get(d.seq_id)
            if r is None or r.mode == Mode.OFF or d.committed_len != len(r.tokens):
                continue  # stale: the request moved on or ended meanwhile
            if predraft:
                r.predraft = PreDraft(tree_from_proto(d.tree), {h.accepted: h.chain for h in d.hedges}, tree_from_proto)
            else:
                r.draft = tree_from_proto(d.tree)
                r.draft_family = draft_family(r.settings, r.mode)
        return rtt, resp.engine_seconds

    def _stop_speculating(self, r: ActiveRequest) -> None:
        self._free_drafter_state(r)
        r.mode, r.auto = Mode.OFF, False

    def _park(self, r: ActiveRequest) -> None:
        """Auto parked r mid-life: no more hidden states from the verifier, no drafter state."""
        self.stop_hidden.append(r.seq_id)
        self._free_drafter_state(r)

    def _free_drafter_state(self, r: ActiveRequest) -> None:
        if r.drafter_len:
            self.close_drafter[r.drafter].append(r.seq_id)
        r.draft, r.predraft, r.drafter_len, r.hidden_rows = None, None, 0, []

    def _drafter_lost(self, address: str, reason: str) -> None:
        affected = [r for r in self.active.values() if r.drafter == address]
        self.log.error("drafter lost; its requests finish in mode off", drafter=address, error=reason,
                       request_ids=[r.req.request_id for r in affected])
        self.drafters.pop(address).reset()
        self.close_drafter.pop(address, None)
        self.on_lost("drafter", address)
        for r in affected:  # a draft already made stays valid and is still verified
            r.mode, r.predraft, r.drafter_len, r.hidden_rows, r.auto = Mode.OFF, None, 0, [], False

    # ---- verdicts ----------------------------------------------------------------------------
    def _apply_verdicts(self, resp: verifier_pb2.VerifyStepResponse) -> int:
        """-> the tokens the verdicts committed."""
        committed = 0
        for err in map(error_from_proto, resp.errors):
            r = self.active.get(err.seq_id)
            if r is None:
                continue
            status = {ErrorCode.INVALID: "INVALID_ARGUMENT", ErrorCode.OUT_OF_CAPACITY: "RESOURCE_EXHAUSTED"}
            self._fail(r, status.get(err.code, "INTERNAL"), f"verifier: {err.message}")
        for v in resp.verdicts:
            r = self.active.get(v.seq_id)
            if r is None or r.cancelled:
                continue
            accepted = list(v.accepted_ids)
            if v.committed_len != len(r.tokens) + len(accepted):
                self._fail(r, "INTERNAL", f"verifier and gateway disagree on the length of {r.seq_id}")
                continue
            if v.HasField("hidden_states"):
                self.release_budget.saw(v.hidden_states)
                if r.speculates:
                    r.hidden_rows.append(v.hidden_states)
            if r.opening:   # the prefill's verdict: the first token, no draft
                r.opening = False
            else:
                self._count_step(r, accepted, v.accepted_drafts)
            self._emit(r, accepted)
            committed += len(accepted)
        return committed

    def _count_step(self, r: ActiveRequest, accepted: list[int], accepted_drafts: int) -> None:
        s = r.stats
        drafted = len(r.draft) if r.draft else 0
        s.steps += 1
        s.drafted += drafted
        s.accepted += accepted_drafts
        s.committed_by_steps += len(accepted)
        depth = r.draft.shape()[0] if r.draft else 0
        if depth:
            self.tally.verdict(depth, accepted_drafts, len(accepted))
        if r.auto:
            self.tally.choices[r.choice or "off"] = self.tally.choices.get(r.choice or "off", 0) + 1
        if self.auto is not None:
            self.auto.observe_verdict(r, depth, accepted_drafts)
        r.draft = None
        if r.predraft is not None:
            foreseen = r.predraft.next_draft(accepted_drafts, drafted, accepted[-1]) if drafted else None
            if self.auto is not None and drafted:
                self.auto.observe_predraft(drafted, foreseen is not None)
            if foreseen is not None:
                r.draft = foreseen
                r.draft_family = "chain"
                s.overlap_hits += 1
                self.tally.hits += 1
            else:
                s.overlap_misses += 1
                self.tally.misses += 1
            r.predraft = None

    def _emit(self, r: ActiveRequest, new: list[int]) -> None:
        new = new[: r.req.max_new_tokens - r.generated]
        finish = None
        if r.req.stop_at_eos:
            eos_at = next((i for i, t in enumerate(new) if t in self.eos_ids), None)
            if eos_at is not None:
                new, finish = new[: eos_at + 1], "eos"
        # Only a request with stop strings is decoded here, where a stop must end it before the next
        # step; the others' text is decoded by their handlers, which run while this loop awaits the
        # services (decoding took a fifth of the gateway's step time at C = 32, stand-ins).
        text = None
        if r.detok.stop:
            text, stopped = r.detok.add(new)
            if stopped:
                new, finish = new[: r.detok.tokens_used], "stop"
        r.tokens += new
        if finish is None and r.generated >= r.req.max_new_tokens:
            finish = "length"
        if finish is not None:
            if text is not None:
                text += r.detok.finish()
            r.finished = True
            self._retire(r)
        if new or finish:
            r.events.put_nowait(Event(r.sample_index, token_ids=new, text=text, finish_reason=finish))

    # ---- endings -----------------------------------------------------------------------------
    def _retire(self, r: ActiveRequest) -> None:
        if self.active.pop(r.seq_id, None) is not None:
            if self.auto is not None:
                self.auto.forget(r)
            self.close_verifier.append(r.seq_id)
            if r.drafter_len and r.drafter in self.drafters:
                self.close_drafter[r.drafter].append(r.seq_id)
            self.on_done(r)

    def _fail(self, r: ActiveRequest, status: str, message: str) -> None:
        r.finished = True
        self._retire(r)
        r.events.put_nowait(Event(r.sample_index, error=(status, message)))

    def _fail_all(self, status: str, message: str) -> None:
        for r in self._release_all():
            r.finished = True
            r.events.put_nowait(Event(r.sample_index, error=(status, message)))

    def _release_all(self) -> list[ActiveRequest]:
        """Every request leaves this scheduler; -> them, reset to resume on a new verifier and
        drafter from their committed tokens (under a new sequence id: the old one may still be
        closing on the drafter)."""
        released = list(self.active.values()) + list(self.pending)
        for r in released:
            if self.auto is not None:
                self.auto.forget(r, ended=False)
            self.on_done(r)
            r.seq_id, r.prefill_leader = uuid.uuid4().hex, ""
            r.draft = r.predraft = None
            r.drafter_len, r.hidden_rows, r.rows_held = 0, [], False
        self.active.clear()
        self.pending.clear()
        # Both ends free these sequences when their streams end: reset instead of closing one by one.
        self.close_verifier, self.stop_hidden = [], []
        self.close_drafter.clear()
        for stream in self.drafters.values():
            stream.reset()
        return released


def concat_payloads(parts: list[common_pb2.TensorPayload], out: common_pb2.TensorPayload) -> None:
    """out := the row-wise concatenation of [m_i, w] payloads of one dtype, without decoding them."""
    if len(parts) == 1:   # the usual case (one verdict since the last draft): one copy, no join
        out.CopyFrom(parts[0])
        return
    first = parts[0]
    out.dtype = first.dtype
    out.shape[:] = [sum(p.shape[0] for p in parts), *first.shape[1:]]
    out.data = b"".join(p.data for p in parts)


async def timed(call: Awaitable) -> tuple[object, float]:
    """(the call's result, its wall seconds)."""
    t0 = time.perf_counter()
    result = await call
    return result, time.perf_counter() - t0


async def wait_at_most(event: asyncio.Event, seconds: float) -> None:
    """event.wait() for at most `seconds`. (Not asyncio.wait_for: on Python 3.11 it can swallow a
    cancellation that lands as the wait completes, and a task that ignores its cancellation keeps
    the process from exiting at shutdown.)"""
    try:
        async with asyncio.timeout(seconds):
            await event.wait()
    except TimeoutError:
        pass
