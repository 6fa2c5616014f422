"""Hidden-state rows the verifier keeps back while the gateway says hold (auto runs a request off).

A held request's rows are sent, in order, with its next verdict that is not held; parking or
closing it drops them. Rows arrive a step at a time, for up to a whole batch: they are copied out of
the step's read-back in one op for all the requests held, and each request's views into those
blocks are merged into one tensor of its own every `merge_every` steps, so a long-lived request
keeps no other request's block alive for longer than that. (A copy per request, sliced out one by
one, cost an off step of 64 held requests 0.51 ms of host time over the same step parked; this
way 0.14 ms: a 4-layer toy model on the 2-core dev VM, timing engine.step alone.)
"""

from __future__ import annotations

import torch


class HeldRows:
    def __init__(self, merge_every: int = 128) -> None:
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
        if kept:   # a copy: views would keep the read-back alive
            self._keep(kept, torch.cat([rows[sid] for sid in kept]), [rows[sid].shape[0] for sid in kept])
        return self._release({sid: r for sid, r in rows.items() if sid not in hold})

    def carry_block(self, seq_ids: list[str], block: torch.Tensor, counts: list[int],
                    hold: set[str]) -> dict[str, torch.Tensor]:
        """carry() for a verify step's read-back block [n, width, .]: row i's first counts[i] rows
        are seq_ids[i]'s. The rows kept back are gathered in one op, so a step that holds a whole
        batch slices no tensor per request."""
        kept = [i for i, sid in enumerate(seq_ids) if sid in hold]
        if kept:
            width = block.shape[1]
            flat = [i * width + j for i in kept for j in range(counts[i])]
            rows = block.reshape(-1, block.shape[-1])[torch.tensor(flat)]   # [sum of kept counts, .], a copy
            self._keep([seq_ids[i] for i in kept], rows, [counts[i] for i in kept])
        return self._release({sid: block[i, :counts[i]] for i, sid in enumerate(seq_ids) if sid not in hold})

    def _keep(self, seq_ids: list[str], rows: torch.Tensor, counts: list[int]) -> None:
        """rows [sum(counts), .]: each seq id's next counts[i], appended to what it holds."""
        for sid, part in zip(seq_ids, rows.split(counts)):
            held = self.rows.setdefault(sid, [])
            held.append(part)
            if len(held) >= self.merge_every:
                self.rows[sid] = [torch.cat(held)]

    def _release(self, rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The rows to send, each after any kept back before."""
        for sid, r in rows.items():
            held = self.rows.pop(sid, None)
            if held is not None:
                rows[sid] = torch.cat([*held, r])
        return rows

    def drop(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            self.rows.pop(sid, None)
