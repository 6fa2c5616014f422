"""How many of the hidden-state rows held on the verifier one step may release, and how many one request may hold.

A request that auto runs off has its rows held on the verifier (verifier_svc/held_rows.py) until it
drafts again; then its next verdict carries all of them (its whole history if it never drafted: a
prompt admitted while auto ran off), and the next draft step forwards them. At C = 64 after ~120
tokens off that was 28 MB in one verdict (8B shapes, fp8 rows projected by the head's fc: 4,100
bytes a row; H100 run 7); after 1,000 tokens it would be ~260 MB, past the 256 MiB gRPC message
limit (specdec/serving.py), and a verifier that cannot send its step's response fails the step:
every request of the batch. So a step releases at most RELEASE_BYTES of held rows (the requests past
it stay held and run off one more step), and a request holding more than HELD_BYTES_PER_REQUEST is
parked (off for the rest of its life, its rows dropped: the verifier's memory for held rows stays
bounded, and a catch-up that large would cost more than its drafts could win back). The row size is
learned from the payloads that arrive; until one has, nothing is limited.
"""

from __future__ import annotations

from specdec.rpc import common_pb2
from specdec.serving import MESSAGE_LIMIT

RELEASE_BYTES = MESSAGE_LIMIT // 4
HELD_BYTES_PER_REQUEST = RELEASE_BYTES // 8


class ReleaseBudget:
    def __init__(self, release_bytes: int = RELEASE_BYTES, held_bytes: int = HELD_BYTES_PER_REQUEST) -> None:
        self.release_bytes, self.held_bytes = release_bytes, held_bytes
        self.row_bytes = 0   # the last payload's bytes per row (0: none seen yet)

    def saw(self, payload: common_pb2.TensorPayload) -> None:
        """A verdict's hidden-state rows arrived."""
        if payload.shape and payload.shape[0]:
            self.row_bytes = len(payload.data) // payload.shape[0]

    def step_rows(self) -> int | None:
        """Held rows one step may release (None: no limit known yet)."""
        return self.release_bytes // self.row_bytes if self.row_bytes else None

    def request_rows(self) -> int | None:
        """Held rows past which a request is parked (None: no limit known yet)."""
        return self.held_bytes // self.row_bytes if self.row_bytes else None
