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


def test_the_stand_in_verifier_keeps_held_rows_back_as_the_engine_does():
    """A prompt admitted with its rows held (auto runs off) sends none with its prefill's verdict; they
    come, in order, with its first verdict not held. (The stand-in once sent a held prompt's rows at
    once: at C = 64 with 8B-wide rows each wave's admission cost it ~400 ms the GPU does not pay.)"""
    from benchmarks.stand_in import StandInVerifier, StepTime
    from specdec.draft_tree import DraftTree
    from verifier_svc.types import OpenSequence, VerifierStep, VerifyItem

    verifier = StandInVerifier(StepTime(0.0, 0.0), 4, 384, 256, aux_width=8)
    prompt = [5, 6, 7]
    opened, = verifier.step(VerifierStep(1, open=[OpenSequence("s", prompt, want_hidden=True)],
                                         hold_hidden=["s"])).verdicts
    assert opened.hidden is None
    held, = verifier.step(VerifierStep(2, verify=[VerifyItem("s", 4, DraftTree())], hold_hidden=["s"])).verdicts
    assert held.hidden is None
    sent, = verifier.step(VerifierStep(3, verify=[VerifyItem("s", 5, DraftTree())])).verdicts
    assert sent.hidden.shape == (len(prompt) + 2, 8)   # the prompt's rows, then one per verify step
