"""--project-hidden-states: the verifier applies an EAGLE-3 head's fc to the hidden-state rows it
sends, and a drafter with --projected-hidden-states (its fc the identity) reads them. Each verdict
then carries exactly fc(rows) of the unprojected verifier (prompt and verify rows, fp8 packing
after the projection), the projected drafter drafts exactly what the unprojected one drafts from
the raw rows (chains with overlap's assumed tokens, trees), rows of the other form are refused,
and both sides name the fc they hold by the same fingerprint whatever dtype they load it in."""

from __future__ import annotations

import pytest
import torch
from test_eagle3_drafter import target_states
from test_eagle3_head import write_head

from drafter_svc.eagle3_engine import Eagle3DrafterEngine
from drafter_svc.types import ChainShape, DraftItem, DrafterStep, TreeShape
from specdec.errors import ErrorCode
from specdec.model.eagle3 import load_eagle3
from specdec.model.fp8_rows import dequantize_rows, quantize_rows
from specdec.model.hidden_projection import load_projection
from specdec.model.loader import load_model
from specdec.model.runner import ModelRunner
from specdec.tree import DraftTree
from verifier_svc.engine import VerifierEngine
from verifier_svc.types import OpenSequence, VerifierStep, VerifyItem

LAYERS = (1, 2, 3)   # the head's aux layers (its config names the outputs of 0, 1, 2)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def head(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("projection") / "head"
    write_head(checkpoints["llama-gqa"], out)
    return out


def verifier(path, **kw) -> VerifierEngine:
    return VerifierEngine(ModelRunner(load_model(path, torch.float64, CPU)), 3, 96, 16, **kw)


@pytest.mark.parametrize("fp8", [False, True], ids=["rows", "fp8-rows"])
def test_projected_verdicts_carry_the_heads_fc_of_the_rows(checkpoints, head, fp8):
    path = checkpoints["llama-gqa"]
    target = load_model(path, torch.float64, CPU).spec
    projection = load_projection(head, target, torch.float64, CPU)
    assert projection.aux_layers == LAYERS and projection.width == target.hidden_size
    plain = verifier(path, aux_layers=LAYERS)
    projecting = verifier(path, projection=projection, hidden_fp8=fp8)   # layers: the head's
    assert projecting.runner.aux_layers == LAYERS
    fc = load_eagle3(head, target, torch.float64, CPU).fc.weight
    step = VerifierStep(0, open=[OpenSequence(s, p, want_hidden=True) for s, p in (("a", [5, 6, 7]), ("b", [9, 4]))])
    for n in range(1, 5):
        want, got = plain.step(step), projecting.step(step)
        assert [(v.seq_id, v.accepted_ids) for v in want.verdicts] == [(v.seq_id, v.accepted_ids) for v in got.verdicts]
        for w, g in zip(want.verdicts, got.verdicts):
            expected = w.hidden @ fc.T                                   # [rows, h]
            if fp8:
                assert g.hidden.dtype == torch.uint8
                torch.testing.assert_close(dequantize_rows(g.hidden, torch.float64),
                                           dequantize_rows(quantize_rows(expected), torch.float64), rtol=0, atol=1e-6)
            else:
                torch.testing.assert_close(g.hidden, expected, rtol=0, atol=1e-12)
        step = VerifierStep(n, verify=[VerifyItem(v.seq_id, v.committed_len, DraftTree.chain([9, 9]))
                                       for v in want.verdicts])


def test_a_projection_with_other_layers_is_refused(checkpoints, head):
    path = checkpoints["llama-gqa"]
    projection = load_projection(head, load_model(path, torch.float64, CPU).spec, torch.float64, CPU)
    with pytest.raises(ValueError, match="differ from the layers"):
        verifier(path, aux_layers=(0, 1, 2), projection=projection)


def drafter(target, head, projected: bool) -> Eagle3DrafterEngine:
    h = load_eagle3(head, target.spec, torch.float64, CPU, projected)
    return Eagle3DrafterEngine(h, target.model.embed_tokens.weight, max_sequences=3, max_context=128)


def test_the_projected_drafter_drafts_what_the_unprojected_one_does(checkpoints, head):
    target = load_model(checkpoints["llama-gqa"], torch.float64, CPU)
    plain, projected = drafter(target, head, False), drafter(target, head, True)
    assert projected.aux_width == target.spec.hidden_size and plain.aux_width == 3 * target.spec.hidden_size
    fc = plain.head.fc.weight.detach()
    context, sent = [5, 6, 7, 9, 11], 0
    shapes = [(ChainShape(4), []), (ChainShape(3), [17, 4]), (TreeShape(3, 3, 8), []), (ChainShape(2), [8])]
    for step, (shape, assumed) in enumerate(shapes * 2, start=1):
        rows = target_states(target, LAYERS, context)[max(0, sent - 1):]
        items = [DraftItem("s", len(context), context[sent:], assumed, shape, hidden=r) for r in (rows, rows @ fc.T)]
        want, got = plain.step(DrafterStep(step, [items[0]])), projected.step(DrafterStep(step, [items[1]]))
        assert not want.errors and not got.errors, (want.errors, got.errors)
        assert got.drafts[0].tree.token_ids == want.drafts[0].tree.token_ids, step
        assert got.drafts[0].tree.parents == want.drafts[0].tree.parents, step
        sent = len(context)
        context += want.drafts[0].tree.token_ids[:2] + [step + 30]   # any tokens: the drafter only drafts


def test_rows_of_the_other_form_are_refused(checkpoints, head):
    target = load_model(checkpoints["llama-gqa"], torch.float64, CPU)
    context = [5, 6, 7]
    raw = target_states(target, LAYERS, context)
    res = drafter(target, head, True).step(DrafterStep(1, [DraftItem("s", 3, context, [], ChainShape(2), hidden=raw)]))
    assert [e.code for e in res.errors] == [ErrorCode.INVALID] and "--project-hidden-states" in res.errors[0].message
    res = drafter(target, head, False).step(DrafterStep(1, [DraftItem("s", 3, context, [], ChainShape(2),
                                                                      hidden=raw[:, :target.spec.hidden_size])]))
    assert [e.code for e in res.errors] == [ErrorCode.INVALID] and "--aux-hidden-layers" in res.errors[0].message


def test_both_sides_name_the_fc_by_one_fingerprint(checkpoints, head, tmp_path):
    target = load_model(checkpoints["llama-gqa"], torch.float64, CPU).spec
    mark = load_projection(head, target, torch.float32, CPU).fingerprint
    assert load_eagle3(head, target, torch.float64, CPU, projected=True).fc_fingerprint == mark
    assert load_eagle3(head, target, torch.float32, CPU).fc_fingerprint == mark
    write_head(checkpoints["llama-gqa"], tmp_path / "other", seed=1)
    assert load_projection(tmp_path / "other", target, torch.float32, CPU).fingerprint != mark
