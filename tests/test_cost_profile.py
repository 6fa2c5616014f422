"""The start-up cost profiles: every shape `--mode auto` may choose is timed at every profiled
batch size, through the engines' real step path, and the profile leaves no sequence or counter
behind (the first request finds the engine as warm-up left it)."""

from __future__ import annotations

import torch

from drafter_svc.cost_profile import measure_draft_costs
from drafter_svc.engine import DrafterEngine
from specdec.cost_profile import AUTO_TREES, profile_batches, profiled_trees, tree_shape
from specdec.model.loader import load_model
from specdec.model.runner import ModelRunner
from verifier_svc.cost_profile import measure_verify_costs
from verifier_svc.engine import VerifierEngine

CPU = torch.device("cpu")


def runner(path) -> ModelRunner:
    return ModelRunner(load_model(path, torch.float32, CPU))


def test_verifier_profile_covers_widths_and_batches_and_leaves_no_trace(checkpoints):
    engine = VerifierEngine(runner(checkpoints["llama-gqa"]), 8, 256, 16)
    costs = measure_verify_costs(engine, reps=1)
    batches = profile_batches(8, CPU)
    assert batches == [1, 4, 8]
    assert {(c.shape, c.batch) for c in costs} == {(f"verify:{w}", b) for w in (1, 5, 17) for b in batches}
    # on a CPU no wide trees, whatever --max-draft-tokens allows
    wide = measure_verify_costs(VerifierEngine(runner(checkpoints["llama-gqa"]), 8, 256, 64), reps=1)
    assert {c.shape for c in wide} == {"verify:1", "verify:5", "verify:17"}
    assert all(c.seconds > 0 for c in costs)
    assert engine.table.opened == 0 and engine.prefill_tokens_computed == 0
    assert engine.table.get("profile-0") is None and len(engine.table._free_slots) == 8


def test_drafter_profile_covers_chains_predrafts_and_trees(checkpoints):
    engine = DrafterEngine(runner(checkpoints["llama-gqa/draft"]), 4, 256)
    costs = measure_draft_costs(engine, reps=1)
    shapes = {c.shape for c in costs}
    assert {"chain:1", "chain:4", "chain:8", "pre:1", "pre:4", "pre:8"} <= shapes
    assert {tree_shape(*t) for t in profiled_trees("cpu")} <= shapes
    assert not {tree_shape(*t) for t in AUTO_TREES if t[2] > 16} & shapes   # wide trees: GPU only
    assert {c.batch for c in costs} == set(profile_batches(4, CPU))
    assert engine.table.opened == 0 and engine.table.get("profile-0") is None


def test_eagle3_drafter_profile(checkpoints, tmp_path):
    from test_eagle3_drafter import engine, setup

    eagle3 = engine(*setup(checkpoints, tmp_path))
    costs = measure_draft_costs(eagle3, reps=1)
    assert {"chain:4", "pre:4", tree_shape(*AUTO_TREES[1])} <= {c.shape for c in costs}
    assert eagle3.table.opened == 0 and eagle3.table.get("profile-0") is None


def test_a_tiny_vocabulary_profiles_only_the_trees_it_can_draft(tmp_path):
    """A drafter of a 5-token vocabulary cannot pick 8 children a node: its profile leaves the
    wide trees out (auto's menu then does too), and a request for one is refused per sequence."""
    from model_factory import make_tiny_vocab_checkpoint

    from drafter_svc.types import DraftItem, DrafterStep, TreeShape
    from specdec.errors import ErrorCode

    engine = DrafterEngine(runner(make_tiny_vocab_checkpoint(tmp_path / "tiny", seed=2)), 4, 256)
    assert engine.draft_vocab_size < 8
    shapes = {c.shape for c in measure_draft_costs(engine, reps=1)}
    assert shapes >= {tree_shape(*t) for t in profiled_trees("cpu") if t[0] <= 4}
    assert not shapes & {tree_shape(*t) for t in AUTO_TREES if t[0] > engine.draft_vocab_size}
    result = engine.step(DrafterStep(1, [DraftItem("w", 3, [1, 2, 3], [], TreeShape(8, 6, 32))]))
    assert not result.drafts and result.errors[0].code == ErrorCode.INVALID and "topk=8" in result.errors[0].message
