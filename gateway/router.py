"""Routes requests across verifier and drafter replicas.

Each healthy verifier replica gets its own Scheduler (batched step loop). A request is pinned
for its lifetime to the least-loaded healthy verifier and the least-loaded healthy drafter
(their KV caches hold its state). Replica sets are re-resolved and health-checked periodically;
a replica whose stream breaks is marked down at once and used again once healthy.

When no verifier is healthy, requests wait (parked) up to `backend_wait` seconds for one instead
of failing at once; the requests of a verifier that is lost mid-stream wait the same way and then
resume on whichever verifier is healthy, from their committed tokens (the new verifier prefills
prompt + output so far), so a failover changes no token. Only when the wait runs out do they end
UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from gateway.admission import AT_ONCE, AdmissionPolicy
from gateway.auto.controller import AutoController
from gateway.backends import StepStream
from gateway.dialer import BackendDialer
from gateway.hold import NO_HOLD, HoldGate
from gateway.replicas import Replica, ReplicaSet
from gateway.request import ActiveRequest, Event, Mode
from gateway.scheduler import Scheduler, wait_at_most
from specdec.cost_profile import StepCost
from specdec.rpc.convert import costs_from_info


PARKED_POLL = 0.25   # seconds between looks for a verifier while requests wait for one
MAX_RESUMES = 3      # a request resumes on a new verifier at most this many times


class NoBackend(RuntimeError):
    """No healthy verifier replica: the request gets UNAVAILABLE."""


class QueueFull(RuntimeError):
    """Too many requests wait for a KV slot: the request gets RESOURCE_EXHAUSTED."""


class Router:
    def __init__(self, verifier_spec: str, drafter_spec: str | None, max_queue: int, eos_ids: set[int],
                 hold: HoldGate = NO_HOLD, auto_cycle: bool = False, dialer: BackendDialer | None = None,
                 backend_wait: float = 10.0, admission: AdmissionPolicy = AT_ONCE) -> None:
        self.admission = admission   # when waiting prompts join a replica's running batch
        self.auto_cycle = auto_cycle   # tests only (--test-auto-cycle)
        self.dialer = dialer or BackendDialer()
        self.verifiers = ReplicaSet("verifier", verifier_spec, self.dialer)
        self.drafters = ReplicaSet("drafter", drafter_spec, self.dialer) if drafter_spec else None
        self.max_queue = max_queue
        self.eos_ids = eos_ids
        self.hold = hold
        self.schedulers: dict[str, Scheduler] = {}
        self.vocab_size: int | None = None
        self._tasks: set[asyncio.Task] = set()
        self._lost = asyncio.Event()  # a scheduler saw a replica's stream break: re-check now
        self.log = structlog.get_logger(service="gateway")
        self._warned_pairs: set[tuple[str, str]] = set()  # (drafter, verifier) whose layers disagree
        self.backend_wait = backend_wait
        # Groups of samples waiting for a healthy verifier, each with its deadline (loop time).
        self.parked: list[tuple[list[ActiveRequest], float]] = []

    async def wait_ready(self, timeout: float, poll: float = 0.5) -> None:
        """Until one verifier (and, if configured, one drafter) answers SERVING."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            await self.refresh()
            if self.verifiers.healthy() and (self.drafters is None or self.drafters.healthy()):
                return
            if loop.time() > deadline:
                raise TimeoutError(f"no healthy verifier{' and drafter' if self.drafters else ''} after {timeout:.0f}s")
            await asyncio.sleep(poll)

    async def refresh(self) -> None:
        sets = [self.verifiers] + ([self.drafters] if self.drafters else [])
        await asyncio.gather(*(s.refresh() for s in sets))
        for replica in [r for s in sets for r in s.healthy()]:
            if self.vocab_size is None:
                self.vocab_size = replica.info.vocab_size
            elif replica.info.vocab_size != self.vocab_size:
                self.log.error("replica has another vocabulary; not used", role=replica.role,
                               address=replica.address, vocab_size=replica.info.vocab_size, expected=self.vocab_size)
                replica.healthy = False
        for replica in self.verifiers.healthy():
            if replica.address not in self.schedulers:
                self._start_scheduler(replica)

    @property
    def load(self) -> int:
        """Requests admitted or waiting, over all verifiers, and those waiting for one."""
        return sum(s.load for s in self.schedulers.values()) + self.parked_count

    @property
    def parked_count(self) -> int:
        """Samples waiting for a healthy verifier."""
        return sum(len(g) for g, _ in self.parked)

    @property
    def can_serve(self) -> bool:
        """A request could be served now: some verifier is healthy (drafters are optional)."""
        return bool(self.verifiers.healthy())

    async def run(self, interval: float, report: Callable[[bool], Awaitable[None]]) -> None:
        """Re-resolve and health-check every `interval` seconds, at once after a replica was
        lost, and report whether a request can be served now."""
        while True:
            # Parked requests: look for a verifier often (their wait is bounded).
            await wait_at_most(self._lost, min(interval, PARKED_POLL) if self.parked else interval)
            self._lost.clear()
            try:
                await self.refresh()
            except Exception:  # keep routing with what we know
                self.log.exception("replica refresh failed")
            self._unpark()
            await report(self.can_serve)

    def limits(self) -> tuple[int, int, int]:
        """(max_context, max_draft_tokens, max_sequences) that every healthy replica accepts."""
        infos = [r.info for s in (self.verifiers, self.drafters) if s for r in s.healthy()]
        v_infos = [r.info for r in self.verifiers.healthy()]
        return (min(i.max_context for i in infos), min(i.max_draft_tokens for i in v_infos),
                min(i.max_sequences for i in infos))

    def _start_scheduler(self, replica: Replica) -> None:
        auto = AutoController(costs_from_info(replica.info), self._drafter_profile, replica.info.max_draft_tokens,
                              cycle=self.auto_cycle, verifier_accelerators=list(replica.info.accelerators),
                              hidden_states=bool(replica.info.aux_hidden_layers))
        sched = Scheduler(StepStream("verifier", replica.address, self.dialer), replica.info.max_sequences,
                          self.eos_ids, on_done=self._on_done, on_lost=self._on_lost, hold=self.hold, auto=auto,
                          dialer=self.dialer, on_orphans=self._on_orphans, admission=self.admission)
        self.schedulers[replica.address] = sched
        task = asyncio.get_running_loop().create_task(sched.run())
        self._tasks.add(task)

    def _drafter_profile(self) -> tuple[list[StepCost], list[str]]:
        """A drafter replica's cost profile and accelerators (replicas serve one draft model: any
        profiled one)."""
        for d in self.drafters.healthy() if self.drafters else []:
            if d.info is not None and d.info.step_costs:
                return costs_from_info(d.info), list(d.info.accelerators)
        return [], []

    def submit(self, samples: list[ActiveRequest]) -> None:
        """Pin a request's samples to one verifier (they share its prefill) and each to a drafter;
        with no verifier healthy, park them for up to `backend_wait` seconds."""
        candidates = self._candidates()
        if not candidates:
            if self.backend_wait <= 0:
                raise NoBackend("no verifier replica is available; retry later")
            if self.parked_count + len(samples) > self.max_queue:
                raise QueueFull(f"{self.max_queue} requests already wait for a verifier; retry later")
            self._park(samples)
            return
        sched = min(candidates, key=lambda s: s.load)
        if len(sched.pending) + len(samples) > self.max_queue:
            raise QueueFull(f"{len(sched.pending)} requests are already waiting; retry later")
        self._place(samples, sched)

    def cancel(self, r: ActiveRequest) -> None:
        """The client went away: free the sample wherever it is now."""
        r.cancelled = True
        sched = self.schedulers.get(r.verifier)
        if sched is not None:
            sched.cancel(r)

    def _candidates(self) -> list[Scheduler]:
        return [self.schedulers[v.address] for v in self.verifiers.healthy() if v.address in self.schedulers]

    def _place(self, samples: list[ActiveRequest], sched: Scheduler) -> None:
        verifier = self.verifiers.replicas[sched.verifier.address]
        for r in samples:
            drafter = None
            if self.drafters and r.mode != Mode.OFF:
                drafter = self.drafters.least_loaded(lambda d: self._pairs_with(d, verifier))
            r.verifier = sched.verifier.address
            r.drafter = drafter.address if drafter else None
            verifier.load += 1
            if drafter:
                drafter.load += 1
            sched.submit(r)

    def _park(self, samples: list[ActiveRequest]) -> None:
        for r in samples:
            r.verifier, r.drafter = "", None
        self.parked.append((samples, asyncio.get_running_loop().time() + self.backend_wait))
        self._lost.set()   # the refresh loop looks for a verifier at once, then every PARKED_POLL

    def _on_orphans(self, samples: list[ActiveRequest]) -> None:
        """A scheduler lost its verifier: its requests wait for another (or the same, back)."""
        live = [r for r in samples if not r.cancelled]
        for r in live:
            r.resumes += 1
        spent = [r for r in live if r.resumes > MAX_RESUMES]
        if spent:   # a request whose verifier keeps dying under it: stop moving it around
            self._fail(spent, f"lost its verifier {MAX_RESUMES + 1} times; retry later")
            live = [r for r in live if r.resumes <= MAX_RESUMES]
        if not live:
            return
        if self.backend_wait <= 0:
            self._fail(live, "the verifier became unavailable and --backend-wait-seconds is 0")
            return
        self.log.warning("requests wait for a verifier to resume on", requests=len(live),
                         wait_seconds=self.backend_wait)
        self._park(live)

    def _unpark(self) -> None:
        now = asyncio.get_running_loop().time()
        waiting, self.parked = self.parked, []
        for samples, deadline in waiting:
            samples = [r for r in samples if not r.cancelled]
            candidates = self._candidates()
            if not samples:
                continue
            if candidates:
                self._place(samples, min(candidates, key=lambda s: s.load))
            elif now >= deadline:
                self._fail(samples, f"no verifier replica became available within {self.backend_wait:g} s; "
                                    "retry later")
            else:
                self.parked.append((samples, deadline))

    @staticmethod
    def _fail(samples: list[ActiveRequest], message: str) -> None:
        for r in samples:
            r.finished = True
            r.events.put_nowait(Event(r.sample_index, error=("UNAVAILABLE", message)))

    def _pairs_with(self, drafter: Replica, verifier: Replica) -> bool:
        """An EAGLE-3 drafter only with a verifier that sends the hidden-state layers it needs, in
        the form it reads (concatenated, or projected by its head's fc)."""
        needs = list(drafter.info.aux_hidden_layers) if drafter.info else []
        if not needs or verifier.info is None:
            return True
        sends, form = list(verifier.info.aux_hidden_layers), verifier.info.hidden_projection
        if needs == sends and drafter.info.hidden_projection == form:
            return True
        if (drafter.address, verifier.address) not in self._warned_pairs:
            self._warned_pairs.add((drafter.address, verifier.address))
            fix = (f"--aux-hidden-layers {','.join(map(str, needs))}" if needs != sends else
                   "--project-hidden-states set to the drafter's head" if drafter.info.hidden_projection else
                   "no --project-hidden-states, or the drafter with --projected-hidden-states")
            self.log.warning("drafter and verifier disagree on hidden states: requests on this verifier run "
                             f"without that drafter (start the verifier with {fix})", drafter=drafter.address,
                             verifier=verifier.address, verifier_sends=sends, verifier_projection=form,
                             drafter_projection=drafter.info.hidden_projection)
        return False

    def _on_done(self, r: ActiveRequest) -> None:
        for replicas, address in ((self.verifiers, r.verifier), (self.drafters, r.drafter)):
            replica = replicas.replicas.get(address) if replicas and address else None
            if replica is not None:
                replica.load -= 1

    def _on_lost(self, role: str, address: str) -> None:
        (self.verifiers if role == "verifier" else self.drafters).mark_down(address)
        self._lost.set()
