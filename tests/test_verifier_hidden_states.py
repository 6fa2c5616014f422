"""Hidden states for an EAGLE-3 drafter: with aux layers configured, every verdict carries the
target's hidden states at those layers' inputs for exactly the positions it committed (a
prefill's prompt; a verify step's root and accepted draft nodes, trees compacted or not), so
that over a sequence's life they tile positions 0..len-2 and equal Hugging Face's hidden states
of the committed tokens. Also through CUDA-graph padding (the CPU stand-in) and through the
protobuf payload (dtype and shape declared, bfloat16 included)."""

from __future__ import annotations

import random

import pytest
import torch
from test_cuda_graphs import EagerGraphs
from transformers import AutoModelForCausalLM

from gateway.scheduler import concat_payloads
from specdec.model.fp8_rows import dequantize_rows, quantize_rows
from specdec.model.loader import load_model
from specdec.model.runner import ModelRunner
from specdec.rpc import common_pb2
from specdec.rpc.tensor_payload import payload_to_tensor, payloads_to_tensors, tensor_to_payload
from specdec.tree import DraftTree
from verifier_svc.engine import VerifierEngine
from verifier_svc.servicer import VerifierServicer
from verifier_svc.types import OpenSequence, VerifierStep, VerifyItem

AUX = (0, 1, 2)


def engine(path, graphed: bool) -> VerifierEngine:
    runner = ModelRunner(load_model(path, torch.float64, torch.device("cpu")))
    eng = VerifierEngine(runner, 3, 96, 16, aux_layers=AUX)
    if graphed:
        runner.graphs = EagerGraphs(
            lambda batch: runner.model.forward_with_aux(batch, runner.cache, AUX), runner.spec.vocab_size,
            runner.cache.num_slots - 1, runner.cache.slot_len, runner.device, (1, 2, 3), (1, 2, 5, 9),
            torch.float64, len(AUX) * runner.spec.hidden_size, torch.float64)
        runner.graphs.capture()
    return eng


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph-padded"])
def test_verdict_hidden_states_tile_the_sequence_and_equal_hf(graphed, checkpoints):
    path = checkpoints["llama-gqa"]
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    eng = engine(path, graphed)
    rng = random.Random(3)
    prompts = {"a": [5, 6, 7, 8], "b": [100, 3], "c": [5, 6, 7, 8]}  # c shares a's prefill
    res = eng.step(VerifierStep(0, open=[OpenSequence(s, p, share_prefill_with="a" if s == "c" else "",
                                                      want_hidden=True) for s, p in prompts.items()]))
    tokens = {v.seq_id: list(prompts[v.seq_id]) + v.accepted_ids for v in res.verdicts}
    hidden = {v.seq_id: [v.hidden] for v in res.verdicts}
    scattered, accepted = 0, 0
    for step in range(1, 8):
        items = []
        for sid, toks in tokens.items():
            with torch.no_grad():  # the target's own continuation, broken at a random point
                cont = hf.generate(torch.tensor([toks]), max_new_tokens=4, do_sample=False, pad_token_id=0)
            good = cont[0, len(toks):].tolist()
            cut = rng.randrange(len(good) + 1)
            chain = good[:cut] + [rng.randrange(380) for _ in range(rng.randint(0, 2))]
            if rng.random() < 0.5 or not chain:
                draft = DraftTree.chain(chain)
            else:  # a wrong sibling first: accepting the chain moves its KV (compaction)
                draft = DraftTree([rng.randrange(380)] + chain, [0, 0] + list(range(2, len(chain) + 1)))
                scattered += 1
            items.append(VerifyItem(sid, len(toks), draft))
        res = eng.step(VerifierStep(step, verify=items))
        assert not res.errors
        for v in res.verdicts:
            assert v.hidden.shape[0] == v.accepted_drafts + 1  # the root and the accepted nodes
            tokens[v.seq_id] += v.accepted_ids
            hidden[v.seq_id].append(v.hidden)
            accepted += v.accepted_drafts
    assert scattered > 3 and accepted > 10  # trees with a moved path and multi-token steps did occur
    h = eng.spec.hidden_size
    for sid, toks in tokens.items():
        got = torch.cat(hidden[sid])                       # [len - 1, 3h]: positions 0 .. len-2
        assert got.shape == (len(toks) - 1, len(AUX) * h)
        with torch.no_grad():
            ref = hf(torch.tensor([toks[:-1]]), output_hidden_states=True).hidden_states
        want = torch.cat([ref[i][0] for i in AUX], -1)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)


def test_fp8_verdicts_carry_the_rows_packed(checkpoints):
    """--hidden-states-fp8: the same tokens, and each verdict's rows are exactly the unpacked
    engine's rows packed by quantize_rows (prompt rows and verify rows alike)."""
    plain = engine(checkpoints["llama-gqa"], graphed=False)
    packing = engine(checkpoints["llama-gqa"], graphed=False)
    packing.hidden_fp8 = True
    step = VerifierStep(0, open=[OpenSequence(s, p, want_hidden=True) for s, p in (("a", [5, 6, 7]), ("b", [9, 4, 8]))])
    for n in range(1, 5):
        want, got = plain.step(step), packing.step(step)
        assert [(v.seq_id, v.accepted_ids) for v in want.verdicts] == [(v.seq_id, v.accepted_ids) for v in got.verdicts]
        for w, g in zip(want.verdicts, got.verdicts):
            assert g.hidden.dtype == torch.uint8 and torch.equal(g.hidden, quantize_rows(w.hidden)), n
        step = VerifierStep(n, verify=[VerifyItem(v.seq_id, v.committed_len, DraftTree.chain([9, 9]))
                                       for v in want.verdicts])


def test_fp8_rows_round_trip_within_the_formats_precision():
    """Each value comes back within 2^-4 of its row's largest magnitude (three mantissa bits),
    at any row scale; a zero row stays zero; packed rows travel as payloads unchanged."""
    rows = torch.randn(6, 40, dtype=torch.float64) * torch.tensor([1e-6, 1e-2, 1.0, 30.0, 5e3, 0.0])[:, None]
    packed = quantize_rows(rows)
    assert packed.dtype == torch.uint8 and packed.shape == (6, 44)
    back = dequantize_rows(packed, torch.float64)
    bound = rows.abs().amax(-1, keepdim=True) * 2 ** -4
    assert torch.all((back - rows).abs() <= bound) and torch.all(back[5] == 0)
    assert torch.equal(dequantize_rows(packed[None, 1:3], torch.float64)[0], back[1:3])   # any leading shape
    msg = tensor_to_payload(packed)
    assert msg.dtype == "float8_e4m3fn_rows" and torch.equal(payload_to_tensor(msg), packed)


def test_stopped_hidden_states_leave_the_verdicts(checkpoints):
    """A step's stop_hidden (auto parked the sequence) ends its hidden states from that step's
    verdict on; the other sequence keeps getting them, the same rows as where nothing stopped
    (only the wanting sequences' rows are gathered)."""
    stopping, control = (engine(checkpoints["llama-gqa"], graphed=False) for _ in range(2))
    opened = [OpenSequence(s, p, want_hidden=True) for s, p in (("a", [5, 6, 7]), ("b", [9, 4]))]
    res = [e.step(VerifierStep(0, open=opened)) for e in (stopping, control)]
    lens = {v.seq_id: v.committed_len for v in res[0].verdicts}
    for step, stop in [(1, []), (2, ["a"]), (3, [])]:
        items = [VerifyItem(s, n, DraftTree.chain([9, 9])) for s, n in lens.items()]
        got = stopping.step(VerifierStep(step, verify=items, stop_hidden=stop))
        want = control.step(VerifierStep(step, verify=items))
        carried = {v.seq_id for v in got.verdicts if v.hidden is not None}
        assert carried == ({"a", "b"} if step == 1 else {"b"}), step
        assert torch.equal(got.verdicts[1].hidden, want.verdicts[1].hidden), step
        lens = {v.seq_id: v.committed_len for v in got.verdicts}


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-rows", "fp8-rows"])
def test_held_hidden_states_come_with_the_next_verdict_in_order(checkpoints, fp8):
    """hold_hidden (auto runs the sequence off for now): its rows stay on the verifier and come,
    in order, with its next verdict of a step that does not hold it - exactly the rows that
    verdicts without holding carried, so the drafter's catch-up sees no difference. Rows held when
    the sequence is parked or closed are dropped."""
    holding, control = (engine(checkpoints["llama-gqa"], graphed=False) for _ in range(2))
    holding.hidden_fp8 = control.hidden_fp8 = fp8
    opened = [OpenSequence(s, p, want_hidden=True) for s, p in (("a", [5, 6, 7]), ("b", [9, 4]))]
    res = [e.step(VerifierStep(0, open=opened)) for e in (holding, control)]
    lens = {v.seq_id: v.committed_len for v in res[0].verdicts}
    want, got = {"a": [], "b": []}, {"a": [], "b": []}
    for step, hold in [(1, ["a"]), (2, ["a", "b"]), (3, []), (4, ["a"])]:
        items = [VerifyItem(s, n, DraftTree.chain([9, 9] if step % 2 else [])) for s, n in lens.items()]
        held = holding.step(VerifierStep(step, verify=items, hold_hidden=hold))
        plain = control.step(VerifierStep(step, verify=items))
        assert [v.accepted_ids for v in held.verdicts] == [v.accepted_ids for v in plain.verdicts]
        assert {v.seq_id for v in held.verdicts if v.hidden is not None} == {"a", "b"} - set(hold), step
        for h, p in zip(held.verdicts, plain.verdicts):
            want[p.seq_id].append(p.hidden)
            if h.hidden is not None:
                got[h.seq_id].append(h.hidden)
        lens = {v.seq_id: v.committed_len for v in held.verdicts}
    assert len(got["a"]) == 1 and torch.equal(got["a"][0], torch.cat(want["a"][:3]))   # steps 1-3 at once
    assert torch.equal(torch.cat(got["b"]), torch.cat(want["b"]))                       # 1, 2-3, 4
    holding.step(VerifierStep(5, verify=[VerifyItem("b", lens["b"], DraftTree())], hold_hidden=["b"]))
    assert "a" in holding.held and "b" in holding.held
    holding.step(VerifierStep(6, stop_hidden=["a"], close=["b"]))
    assert not holding.held


def test_a_prompts_held_rows_come_with_its_first_unheld_verdict(checkpoints):
    """A prompt admitted while auto runs off: its prefill's rows are held too, whole prompts and in
    chunks, and come before its first unheld verify verdict's."""
    for chunk in (0, 2):
        holding, control = (engine(checkpoints["llama-gqa"], graphed=False) for _ in range(2))
        holding.prefills.chunk = control.prefills.chunk = chunk
        opened = [OpenSequence("a", [5, 6, 7, 8, 9], want_hidden=True)]
        want, got = [], []
        for e, out, hold in ((holding, got, ["a"]), (control, want, [])):
            res = e.step(VerifierStep(0, open=opened, hold_hidden=hold))
            while not res.verdicts:   # chunked: the prompt's verdict comes with its last chunk
                res = e.step(VerifierStep(1, hold_hidden=hold))
            out += [v.hidden for v in res.verdicts if v.hidden is not None]
            n = res.verdicts[0].committed_len
            res = e.step(VerifierStep(2, verify=[VerifyItem("a", n, DraftTree.chain([9, 9]))]))
            out += [v.hidden for v in res.verdicts]
        assert len(got) == 1 and torch.equal(got[0], torch.cat(want)), chunk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_payload_round_trip(dtype):
    t = torch.randn(3, 10).to(dtype)
    msg = tensor_to_payload(t)
    assert msg.dtype == str(dtype).removeprefix("torch.") and list(msg.shape) == [3, 10]
    assert torch.equal(payload_to_tensor(msg), t)


def test_a_steps_payloads_decode_together():
    """The drafter decodes a step's payloads at once (one buffer, split by rows): each comes back
    itself, in order, empty and strided ones included; other widths and dtypes one by one."""
    base = torch.randn(4, 5, 12).to(torch.bfloat16)
    rows = [base[0, :3], base[1, :0], base[2, :5], base[:, 3], base[3, 1:2]]   # base[:, 3]: not contiguous
    mixed = [torch.randn(2, 3), torch.randn(1, 3).to(torch.float16), torch.randn(2, 2, 3), base[0, :2, :4]]
    for group in (rows, rows[::-1], rows[2:3], mixed, rows + mixed, [rows[0], torch.randn(2, 12)]):
        decoded = payloads_to_tensors([tensor_to_payload(t) for t in group])
        assert len(decoded) == len(group)
        assert all(d.dtype == t.dtype and torch.equal(d, t) for d, t in zip(decoded, group))
    decoded = payloads_to_tensors([tensor_to_payload(rows[0]), tensor_to_payload(rows[2])])
    decoded[0].zero_()  # writable, and a copy: the other rows do not change
    assert torch.equal(decoded[1], rows[2])


def test_the_gateway_joins_a_requests_verdict_rows_for_its_next_draft():
    """Rows from several verdicts (a request verified twice between drafts) reach the drafter as
    one payload in order; a lone verdict's rows pass unchanged. The gateway does not decode them."""
    parts = [torch.randn(n, 6).to(torch.bfloat16) for n in (3, 1, 2)]
    for group in (parts, parts[:1]):
        out = common_pb2.TensorPayload()
        concat_payloads([tensor_to_payload(t) for t in group], out)
        assert list(out.shape) == [sum(t.shape[0] for t in group), 6] and out.dtype == "bfloat16"
        assert torch.equal(payload_to_tensor(out), torch.cat(group))


@pytest.mark.parametrize("bad, complaint", [
    (common_pb2.TensorPayload(dtype="int8", shape=[1], data=b"x"), "dtype 'int8'"),
    (common_pb2.TensorPayload(dtype="float32", shape=[2, 3], data=bytes(20)), "needs 24 bytes, it has 20"),
])
def test_a_malformed_payload_is_refused_with_the_reason(bad, complaint):
    good = tensor_to_payload(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=complaint):
        payloads_to_tensors([good, bad])


def test_servicer_ships_the_hidden_states(checkpoints):
    eng = engine(checkpoints["llama-gqa"], False)
    servicer = VerifierServicer.__new__(VerifierServicer)
    res = eng.step(VerifierStep(0, open=[OpenSequence("a", [1, 2, 3], want_hidden=True), OpenSequence("b", [4, 5])]))
    assert res.verdicts[1].hidden is None  # only who asks gets them
    msg = servicer.result_to_proto(res)
    assert torch.equal(payload_to_tensor(msg.verdicts[0].hidden_states), res.verdicts[0].hidden)
    assert list(msg.verdicts[0].hidden_states.shape) == [3, len(AUX) * eng.spec.hidden_size]
    # the request side: a parked sequence's stop reaches the engine
    from specdec.rpc import verifier_pb2

    step = servicer.step_from_proto(verifier_pb2.VerifyStepRequest(step=1, stop_hidden_states=["a"]))
    assert step.stop_hidden == ["a"]
