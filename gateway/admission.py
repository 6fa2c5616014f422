"""When waiting prompts join a verifier's running batch: at once while the batch is small, in groups once it is large.

A step that takes in prompts pays a fixed cost over a clean step whatever their number: the
verifier's prefill forward (or its folded rows' graph), a drafter's prompt feed, the gateway's
bookkeeping. Clients that run in step send their next prompts together, and one step admits them
all; once requests end at different steps (speculation makes them: each commits its own number
of tokens a step), prompts arrive one or two a step and every step pays that fixed cost for one.
On stand-ins with an 8B verifier's costs at C = 64, admitting only every 4th step raised the
engines' throughput 8% (BENCHMARKS.md, "auto's token calibration"). So, like TGI's
`waiting_served_ratio` and `max_waiting_tokens` (and vLLM's scheduler delay), prompts wait
until they number `fraction` of the running requests, or the oldest has waited `max_wait_steps`
steps: a bound on the time to first token that grouping adds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdmissionPolicy:
    fraction: float = 0.0     # waiting prompts join once they number this share of the running requests
    max_wait_steps: int = 0   # ... or the oldest has waited this many steps (0: always at once)

    def due(self, waiting: int, oldest_wait_steps: int, running: int) -> bool:
        """Whether this step admits: `waiting` prompts wait (the oldest for `oldest_wait_steps`
        steps) beside `running` requests that advance this step (none: nothing to group with)."""
        if waiting == 0:
            return False
        return (running == 0 or self.max_wait_steps <= 0 or oldest_wait_steps >= self.max_wait_steps
                or waiting >= self.fraction * running)


AT_ONCE = AdmissionPolicy()


def is_wave(admitted: int, batch: int) -> bool:
    """A step that admits `admitted` prompts into a batch of `batch` sequences (the prompts included)
    takes in a wave: half the batch or more at once (the log summary counts its steps apart)."""
    return admitted > 0 and 2 * admitted >= batch
