"""A test-only hook that holds a request at a token count until released.

Failure tests (a backend killed mid-request, a deadline, a cancel, a full queue) must not depend
on the server being slow: with `--test-hold-dir DIR` (off by default), a file `DIR/<request_id>`
holding a number N stops every sample of that request from taking part in steps once it has
generated N tokens; the client has then received exactly what those steps produced and nothing
more arrives until the file is removed. Held samples keep their KV state and pending draft;
cancellation and deadlines still free them. Without the flag nothing is read.
"""

from __future__ import annotations

from pathlib import Path

from gateway.request import ActiveRequest

# How often a scheduler whose every request is held looks at the hold files again.
POLL_SECONDS = 0.01


class HoldGate:
    def __init__(self, directory: Path | None) -> None:
        self.directory = directory

    def held(self, r: ActiveRequest) -> bool:
        if self.directory is None:
            return False
        name = r.req.request_id
        if not name or "/" in name or name.startswith("."):
            return False
        try:
            after = int((self.directory / name).read_text().strip() or "0")
        except (FileNotFoundError, ValueError):
            return False
        return r.generated >= after


NO_HOLD = HoldGate(None)
