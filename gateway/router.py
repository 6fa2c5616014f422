"""Routes requests across verifier and drafter replicas.

Each healthy verifier replica gets its own Scheduler (batched step loop). A request is pinned
for its lifetime to the least-loaded healthy verifier and the least-loaded healthy drafter
(their KV caches hold its state). Replica sets are re-resolved and health-checked periodically;
a replica whose stream breaks is marked down at once and used again once healthy.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog

from gateway.auto.controller import AutoController
from gateway.backends import StepStream
from gateway.dialer import BackendDialer
from gateway.hold import NO_HOLD, HoldGate
from gateway.replicas import Replica, ReplicaSet
from gateway.request import ActiveRequest, Mode
from gateway.scheduler import Scheduler, wait_at_most
from specdec.cost_profile import StepCost
from specdec.rpc.convert import costs_from_info


class NoBackend(RuntimeError):
    """No healthy verifier replica: the request gets UNAVAILABLE."""


class QueueFull(RuntimeError):
    """Too many requests wait for a KV slot: the request gets RESOURCE_EXHAUSTED."""


class Router:
    def __init__(self, verifier_spec: str, drafter_spec: str | None, max_queue: int, eos_ids: set[int],
                 hold: HoldGate = NO_HOLD, auto_cycle: bool = False, dialer: BackendDialer | None = None) -> None:
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
        """Requests admitted or waiting, over all verifiers."""
        return sum(s.load for s in self.schedulers.values())

    @property
    def can_serve(self) -> bool:
        """A request could be served now: some verifier is healthy (drafters are optional)."""
        return bool(self.verifiers.healthy())

    async def run(self, interval: float, report: Callable[[bool], Awaitable[None]]) -> None:
        """Re-resolve and health-check every `interval` seconds, at once after a replica was
        lost, and report whether a request can be served now."""
        while True:
            await wait_at_most(self._lost, interval)
            self._lost.clear()
            try:
                await self.refresh()
            except Exception:  # keep routing with what we know
                self.log.exception("replica refresh failed")
            await report(self.can_serve)

    def limits(self) -> tuple[int, int, int]:
        """(max_context, max_draft_tokens, max_sequences) that every healthy replica accepts."""
        infos = [r.info for s in (self.verifiers, self.drafters) if s for r in s.healthy()]
        v_infos = [r.info for r in self.verifiers.healthy()]
        return (min(i.max_context for i in infos), min(i.max_draft_tokens for i in v_infos),
                min(i.max_sequences for i in infos))

    def _start_scheduler(self, replica: Replica) -> None:
        auto = AutoController(costs_from_info(replica.info), self._drafter_costs, replica.info.max_draft_tokens,
                              cycle=self.auto_cycle)
        sched = Scheduler(StepStream("verifier", replica.address, self.dialer), replica.info.max_sequences,
                          self.eos_ids, on_done=self._on_done, on_lost=self._on_lost, hold=self.hold, auto=auto,
                          dialer=self.dialer)
        self.schedulers[replica.address] = sched
        task = asyncio.get_running_loop().create_task(sched.run())
        self._tasks.add(task)

    def _drafter_costs(self) -> list[StepCost]:
        """A drafter replica's cost profile (replicas serve one draft model: any profiled one)."""
        for d in self.drafters.healthy() if self.drafters else []:
            if d.info is not None and d.info.step_costs:
                return costs_from_info(d.info)
        return []

    def submit(self, samples: list[ActiveRequest]) -> Scheduler:
        """Pin a request's samples to one verifier (they share its prefill) and each to a drafter."""
        candidates = [self.schedulers[v.address] for v in self.verifiers.healthy() if v.address in self.schedulers]
        if not candidates:
            raise NoBackend("no verifier replica is available; retry later")
        sched = min(candidates, key=lambda s: s.load)
        if len(sched.pending) + len(samples) > self.max_queue:
            raise QueueFull(f"{len(sched.pending)} requests are already waiting; retry later")
        verifier = self.verifiers.replicas[sched.verifier.address]
        for r in samples:
            drafter = None
            if self.drafters and r.mode != Mode.OFF:
                drafter = self.drafters.least_loaded(lambda d: self._pairs_with(d, verifier))
            r.verifier = sched.verifier.address
            r.drafter = drafter.address if drafter else None
            self.verifiers.replicas[r.verifier].load += 1
            if drafter:
                drafter.load += 1
            sched.submit(r)
        return sched

    def _pairs_with(self, drafter: Replica, verifier: Replica) -> bool:
        """An EAGLE-3 drafter only with a verifier that sends the hidden-state layers it needs."""
        needs = list(drafter.info.aux_hidden_layers) if drafter.info else []
        if not needs or verifier.info is None or needs == list(verifier.info.aux_hidden_layers):
            return True
        if (drafter.address, verifier.address) not in self._warned_pairs:
            self._warned_pairs.add((drafter.address, verifier.address))
            self.log.warning("drafter and verifier disagree on hidden-state layers: requests on this verifier run "
                             "without that drafter (start the verifier with --aux-hidden-layers "
                             f"{','.join(map(str, needs))})", drafter=drafter.address, verifier=verifier.address,
                             verifier_sends=list(verifier.info.aux_hidden_layers))
        return False

    def _on_done(self, r: ActiveRequest) -> None:
        for replicas, address in ((self.verifiers, r.verifier), (self.drafters, r.drafter)):
            replica = replicas.replicas.get(address) if replicas and address else None
            if replica is not None:
                replica.load -= 1

    def _on_lost(self, role: str, address: str) -> None:
        (self.verifiers if role == "verifier" else self.drafters).mark_down(address)
        self._lost.set()
