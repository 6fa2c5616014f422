"""Hidden-state rows the verifier keeps back while the gateway says hold (auto runs a request off).

A held request's rows are sent, in order, with its next verdict that is not held; parking or
closing it drops them. Rows arrive a step at a time, for up to a whole batch: they are copied out of
the step's read-back in one op for all the requests held (a copy per request cost a 64-request
off step ~0.5-1 ms of host time, as much as the rest of the engine's Python for that step), and
each request's views into those blocks are merged into one tensor of its own every `merge_every`
steps, so a long-lived request keeps no other request's block alive for longer than that.
"""

from __future__ import annotations

import torch


class HeldRows:
    def __init__(self, merge_every: int = 32) -> None:
        self.merge_every = merge_every
        self.rows: dict[str, list[torch.Tensor]] = {}   # seq id -> its rows kept back, host, in order

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def carry(self, rows: dict[str, torch.Tensor], hold: set[str]) -> dict[str, torch.Tensor]:
        """One step's rows by seq id ([tokens, .] each): those in `hold` are kept back; -> the rows
        the others' verdicts carry (after any kept back before)."""
        kept = [sid for sid in rows if sid in hold]
        if kept:
            block = torch.cat([rows[sid] for sid in kept])   # a copy: views would keep the read-back alive
            for sid, part in zip(kept, block.split([rows[sid].shape[0] for sid in kept])):
                held = self.rows.setdefault(sid, [])
                held.append(part)
                if len(held) >= self.merge_every:
                    self.rows[sid] = [torch.cat(held)]
        sent = {}
        for sid, r in rows.items():
            if sid not in hold:
                held = self.rows.pop(sid, None)
                sent[sid] = r if held is None else torch.cat([*held, r])
        return sent

    def drop(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            self.rows.pop(sid, None)
