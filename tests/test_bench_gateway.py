"""scripts/bench_gateway.py: the stand-in engines behind a real gateway give every mode the same
tokens (so the figures compare like with like), speculate at the set acceptance, and the step
split charges the stand-ins' modelled engine time as engine time."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_gateway  # noqa: E402


def test_stand_ins_serve_every_mode_the_same_tokens_at_the_set_acceptance():
    rows = bench_gateway.main(["--concurrency", "2", "--requests-per-client", "2", "--max-new-tokens", "24",
                               "--prompt-len", "12",
                               "--acceptance", "0.8", "--verify-ms", "2", "0", "--draft-ms", "1", "0",
                               "--aux-width", "64", "--modes", "off", "chain k=4 no-overlap", "chain k=4",
                               "tree topk=2", "auto"])
    off, *speculating, auto = rows
    assert all(len(out) == 24 for out in off.outputs)
    assert len({tuple(out) for out in off.outputs}) == len(off.outputs)   # the prompts differ, so do the answers
    assert auto.outputs == off.outputs
    for row in speculating:
        assert row.outputs == off.outputs, row.config
        assert 2.0 < row.accept_len < 5.0, row.config   # k = 4 (a tree: depth 4) at a = 0.8: 3.36 expected
    assert off.accept_len == 1.0
    assert off.verify_ms >= 2.0                                     # the modelled verify step, as engine time
    assert speculating[0].draft_engine_ms > 0.5                     # (per gateway step, prompt steps included)
