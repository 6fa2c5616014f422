"""The gateway's rules when a verifier step does not come back, with a stand-in verifier stream:
a lost verifier (its stream broke) hands its requests on to resume elsewhere, from their committed
tokens under new sequence ids; a verifier that failed the step (INTERNAL: it is up, the work is
bad) fails the step's requests instead of retrying them forever; and a request that keeps losing
its verifier stops being moved after MAX_RESUMES. (Failover between real processes:
test_e2e_failures.py, test_replicas.py, test_fault_injection.py.)"""

from __future__ import annotations

import asyncio

from gateway.backends import BackendLost
from gateway.request import ActiveRequest, GenerationRequest, Mode, SpecSettings
from gateway.router import MAX_RESUMES, Router
from gateway.scheduler import Scheduler
from specdec.sampling import GREEDY


class BrokenVerifier:
    address = "127.0.0.1:9"

    def __init__(self, failed: bool) -> None:
        self.failed = failed

    async def step(self, msg):
        raise BackendLost(f"verifier at {self.address}: gone", failed=self.failed)

    def reset(self) -> None:
        pass


def sample(tokens: list[int] | None = None) -> ActiveRequest:
    req = GenerationRequest("r", [1, 2, 3], 8, [], False, SpecSettings(Mode.OFF), GREEDY)
    return ActiveRequest(req=req, seq_id="s0", mode=Mode.OFF, detok=None, sampling=GREEDY,
                         tokens=list(tokens or []))


async def run_one_step(failed: bool, r: ActiveRequest) -> list[list[ActiveRequest]]:
    orphans: list[list[ActiveRequest]] = []
    sched = Scheduler(BrokenVerifier(failed), 4, set(), on_orphans=orphans.append)
    sched.submit(r)
    task = asyncio.get_running_loop().create_task(sched.run())
    for _ in range(100):
        await asyncio.sleep(0.01)
        if orphans or not r.events.empty():
            break
    task.cancel()
    assert sched.load == 0
    return orphans


def test_lost_verifier_hands_its_requests_on_with_their_tokens():
    r = sample([1, 2, 3, 40, 41])
    orphans = asyncio.run(run_one_step(False, r))
    assert orphans == [[r]] and r.events.empty()
    assert r.tokens == [1, 2, 3, 40, 41] and r.seq_id != "s0" and not r.finished


def test_failed_step_ends_its_requests_internal_without_a_retry():
    r = sample()
    orphans = asyncio.run(run_one_step(True, r))
    assert orphans == [] and r.finished
    assert r.events.get_nowait().error == ("INTERNAL", "the verifier failed the step: verifier at 127.0.0.1:9: gone")


def test_a_request_stops_moving_after_max_resumes():
    async def main():
        router = Router("127.0.0.1:9", None, 16, set())
        r = sample()
        for _ in range(MAX_RESUMES):
            router._on_orphans([r])
            assert r.events.empty() and router.load == 1
            router.parked.clear()
        router._on_orphans([r])
        return r, router

    r, router = asyncio.run(main())
    status, message = r.events.get_nowait().error
    assert status == "UNAVAILABLE" and f"lost its verifier {MAX_RESUMES + 1} times" in message
    assert router.load == 0 and r.finished
