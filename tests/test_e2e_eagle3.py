"""An EAGLE-3 drafter end to end: three real processes over real gRPC, the verifier sending the
target's hidden states (--aux-hidden-layers) with its verdicts, the gateway forwarding them with
the committed tokens, the drafter drafting from a head in the published layout (--eagle3-head).
Greedy output equals Hugging Face's greedy generate in chain mode with and without overlap, and
speculation really ran, in chain mode (overlap on and off) and tree mode, with the rows as computed,
packed to fp8, and projected by the head's fc on the verifier. A verifier that does not send the
head's layers, or sends them in the other form (projected or not), is not paired with the drafter
(ServiceInfo says which layers and which form each has), and its requests stay lossless in mode off."""

from __future__ import annotations

import pytest
import torch
from model_factory import hf_greedy
from test_eagle3_head import write_head

PROMPTS = [[1, 17, 42, 99, 5], [300, 12, 7], list(range(40, 61))]


@pytest.fixture(scope="module")
def head(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle3") / "head"
    write_head(checkpoints["llama-gqa"], out, aux=(0, 1, 2))  # layer outputs 0, 1, 2 = inputs 1, 2, 3
    return out


@pytest.mark.parametrize("fp8, projected", [(False, False), (True, False), (True, True)],
                         ids=["bf16-rows", "fp8-rows", "projected-fp8-rows"])
def test_eagle3_chains_are_lossless(checkpoints, head, start_cluster, fp8, projected):
    """fp8-rows: the verifier packs the hidden states to float8 (--hidden-states-fp8); projected:
    it applies the head's fc to them first (--project-hidden-states, the drafter with
    --projected-hidden-states), as `specdec serve` runs an EAGLE-3 head."""
    target = checkpoints["llama-gqa"]
    rows = ["--project-hidden-states", str(head)] if projected else ["--aux-hidden-layers", "1,2,3"]
    rows.append("--hidden-states-fp8" if fp8 else "--no-hidden-states-fp8")
    reads = ["--projected-hidden-states"] if projected else []
    cluster = start_cluster(target, target, verifier_extra=rows, drafter_extra=["--eagle3-head", str(head), *reads])
    assert cluster.info("verifier").hidden_projection == cluster.info("drafter").hidden_projection
    assert bool(cluster.info("drafter").hidden_projection) == projected
    for prompt in PROMPTS:
        want = hf_greedy(target, prompt, 24)
        for spec in ({"k": 4}, {"k": 3, "overlap": False}):
            ids, final = cluster.generate(prompt, 24, "chain", **spec)
            assert ids == want, (prompt, spec)
            assert final.stats.mode == "chain" and final.stats.drafted > 0, final.stats
        ids, final = cluster.generate(prompt, 24, "tree", topk=2, depth=3, budget=6)
        assert ids == want
        assert final.stats.mode == "tree" and final.stats.drafted > 0, final.stats
    assert ("hidden states travel packed to float8" in (cluster.log_dir / "verifier.log").read_text()) == fp8


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_eagle3_hedged_pre_drafts_are_lossless(checkpoints, head, start_cluster, device):
    """--hedge-predrafts: every overlap pre-draft also carries a hedge per draft position (the
    drafter's engine test checks what they hold); the gateway takes one only for the verdict it
    foresaw, so greedy chains stay HF's, and a sampled request (no hedges) still runs. On CUDA the
    hedges run the Triton attention under their masks, beside the head's graph replays."""
    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, target, device=device, dtype="float64" if device == "cpu" else "float32",
                            verifier_extra=["--aux-hidden-layers", "1,2,3"],
                            drafter_extra=["--eagle3-head", str(head), "--hedge-predrafts"])
    for prompt in PROMPTS:
        ids, final = cluster.generate(prompt, 24, "chain", k=4)
        assert ids == hf_greedy(target, prompt, 24), prompt
        s = final.stats
        assert s.mode == "chain" and s.overlap_hits + s.overlap_misses > 0, s
    ids, final = cluster.generate(PROMPTS[0], 16, "chain", sampling={"temperature": 0.8, "seed": 3}, k=3)
    assert len(ids) == 16 and final.stats.drafted > 0
    assert "hedge_predrafts=True" in (cluster.log_dir / "drafter.log").read_text()


@pytest.mark.parametrize("projected", [False, True], ids=["rows", "projected-rows"])
def test_eagle3_with_a_tensor_parallel_verifier(checkpoints, head, start_cluster, projected):
    """TP 2 (gloo): rank 0 captures the states of its full residual stream (and projects them by
    the head's fc, as `specdec serve` has it); the other rank runs the same collectives without them."""
    target = checkpoints["llama-gqa"]
    rows = ["--project-hidden-states", str(head)] if projected else ["--aux-hidden-layers", "1,2,3"]
    cluster = start_cluster(target, target, verifier_extra=[*rows, "--tp", "2"],
                            drafter_extra=["--eagle3-head", str(head), *(["--projected-hidden-states"] * projected)])
    ids, final = cluster.generate(PROMPTS[2], 24, "chain", k=4)
    assert ids == hf_greedy(target, PROMPTS[2], 24) and final.stats.mode == "chain" and final.stats.drafted > 0


def test_eagle3_without_hidden_states_stays_lossless(checkpoints, head, start_cluster):
    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, target, drafter_extra=["--eagle3-head", str(head)])  # no --aux-hidden-layers
    assert list(cluster.info("drafter").aux_hidden_layers) == [1, 2, 3]
    assert list(cluster.info("verifier").aux_hidden_layers) == []
    ids, final = cluster.generate(PROMPTS[0], 16, "chain", k=4)
    assert ids == hf_greedy(target, PROMPTS[0], 16) and final.stats.mode == "off"
    # the gateway did not pair them (rather than the drafter refusing each request)
    assert "disagree on hidden states" in (cluster.log_dir / "gateway.log").read_text()


@pytest.mark.parametrize("verifier_projects", [False, True], ids=["drafter-expects-projected", "verifier-projects"])
def test_eagle3_rows_in_the_other_form_are_not_paired(checkpoints, head, start_cluster, verifier_projects):
    """One side projects by the head's fc, the other does not: the gateway does not pair them
    (ServiceInfo.hidden_projection), and requests stay lossless in mode off."""
    target = checkpoints["llama-gqa"]
    verifier = ["--project-hidden-states", str(head)] if verifier_projects else ["--aux-hidden-layers", "1,2,3"]
    drafter = [] if verifier_projects else ["--projected-hidden-states"]
    cluster = start_cluster(target, target, verifier_extra=verifier,
                            drafter_extra=["--eagle3-head", str(head), *drafter])
    assert list(cluster.info("verifier").aux_hidden_layers) == [1, 2, 3]
    ids, final = cluster.generate(PROMPTS[0], 16, "chain", k=4)
    assert ids == hf_greedy(target, PROMPTS[0], 16) and final.stats.mode == "off"
    assert "disagree on hidden states" in (cluster.log_dir / "gateway.log").read_text()


def test_eagle3_under_auto_switching_shapes_every_step(checkpoints, head, start_cluster):
    """Auto cycling through off, chains and trees: hidden states of the tokens committed while off
    are kept and forwarded when drafting resumes, so the drafter never refuses a request (it would
    end in mode off) and the output stays lossless."""
    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, target, verifier_extra=["--aux-hidden-layers", "1,2,3"],
                            drafter_extra=["--eagle3-head", str(head)], gateway_extra=["--test-auto-cycle"],
                            extra=["--cost-profile"])
    for prompt in PROMPTS:
        ids, final = cluster.generate(prompt, 32, "auto")
        assert ids == hf_greedy(target, prompt, 32)
        s = final.stats
        assert s.mode == "auto" and s.steps_by_mode["off"] >= 2 and s.drafted > 0, s


def test_eagle3_request_parked_mid_life_stays_lossless(checkpoints, head, start_cluster):
    """auto with a head that never pays (random weights): once auto settles on off, the request that
    has been running (and drafting) since before is parked mid-life -- its drafter state is freed
    and the verifier stops its hidden states -- and its output stays the target's greedy output."""
    from cluster import request

    target = checkpoints["llama-gqa"]
    cluster = start_cluster(target, target, verifier_extra=["--aux-hidden-layers", "1,2,3"],
                            drafter_extra=["--eagle3-head", str(head)], extra=["--cost-profile"], hold=True)
    prompt, n, hold_at = PROMPTS[0], 240, 220
    cluster.hold("long", hold_at)
    req = request(prompt, n, "auto")
    req.request_id = "long"
    stream = cluster.gateway.Generate(req, timeout=300)
    ids, final = [], None
    while len(ids) < hold_at:
        ids += next(stream).token_ids
    assert cluster.info("drafter").active_sequences == 0      # parked: its drafter state freed
    cluster.release("long")
    for msg in stream:
        ids += msg.token_ids
        final = msg.final if msg.HasField("final") else final
    assert ids == hf_greedy(target, prompt, n)
    assert final.stats.drafted > 0 and final.stats.steps_by_mode["off"] > 0, final.stats
