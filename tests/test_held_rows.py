"""The verifier's held hidden-state rows (verifier_svc/held_rows.py): kept in order, sent after
those kept before, and never keeping another request's rows alive for long."""

from __future__ import annotations

import torch

from verifier_svc.held_rows import HeldRows


def _step_rows(step: int, ids: list[str]) -> dict[str, torch.Tensor]:
    """One step's read-back ([requests, 3, 4]) and a row of it per request, as the engine slices it."""
    readback = torch.arange(len(ids) * 12, dtype=torch.float32).reshape(len(ids), 3, 4) + 1000 * step
    return {sid: readback[i][:1 + i % 2] for i, sid in enumerate(ids)}


def test_held_rows_come_in_order_after_those_kept_before():
    held = HeldRows(merge_every=4)
    want = {"a": [], "b": []}
    for step in range(10):
        rows = _step_rows(step, ["a", "b"])
        for sid in rows:
            want[sid].append(rows[sid].clone())
        sent = held.carry(rows, {"a", "b"} if step < 9 else {"a"})
        assert set(sent) == ({"b"} if step == 9 else set())
    assert torch.equal(sent["b"], torch.cat(want["b"]))
    last = _step_rows(10, ["a"])["a"]
    assert torch.equal(held.carry({"a": last}, set())["a"], torch.cat(want["a"] + [last]))
    assert "a" not in held and len(held) == 0


def test_a_long_held_request_keeps_no_other_rows_alive():
    """Rows are copied out of each step's read-back, and a request's copies are merged every
    merge_every steps: what it holds references no read-back, and at most merge_every blocks."""
    held = HeldRows(merge_every=4)
    steps = [_step_rows(step, ["a", "b", "c"]) for step in range(11)]   # (kept alive: no address reused)
    for step, rows in enumerate(steps):
        held.carry(rows, {"a"} | ({"b", "c"} if step == 0 else set()))
    storages = {t.untyped_storage().data_ptr() for t in held.rows["a"]}
    assert not storages & {r["a"].untyped_storage().data_ptr() for r in steps}
    assert len(held.rows["a"]) < 4 and len(storages) <= 4
    held.drop(["a", "b"])
    assert len(held) == 0


def test_a_verify_steps_block_is_carried_as_its_rows_one_by_one():
    """carry_block (a verify step's read-back, row i's first counts[i] rows) keeps and sends
    exactly what carry does with those rows sliced out."""
    by_block, by_rows = HeldRows(merge_every=3), HeldRows(merge_every=3)
    ids = ["a", "b", "c"]
    for step in range(7):
        block = torch.arange(3 * 4 * 2, dtype=torch.float32).reshape(3, 4, 2) + 100 * step
        counts = [1 + (step + i) % 4 for i in range(3)]
        hold = {"a", "b", "c"} - {ids[step % 3]} if step < 6 else set()
        got = by_block.carry_block(ids, block, counts, hold)
        want = by_rows.carry({sid: block[i, :counts[i]] for i, sid in enumerate(ids)}, hold)
        assert got.keys() == want.keys() and all(torch.equal(got[s], want[s]) for s in got), step
