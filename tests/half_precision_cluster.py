"""Half-precision serving judged against a float32 reference, for any device: every mode solo and
batched on a running cluster, each first divergence from mode off (and off's from HF float32
greedy) a near-tie of the fp32 logits, every emitted token within the half-precision noise of the
fp32 maximum (the rule and why it catches logic bugs: tests/test_e2e_bf16_cuda.py). Also the
"wide" model whose bf16 rounding matters. Used by test_e2e_bf16_cuda.py and test_e2e_bf16_cpu.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from model_factory import VOCAB, make_tokenizer
from near_ties import gaps, judge_divergence, publish, table, teacher_forced_logits
from test_e2e_lossless import MODES  # (off; chain k=4 + overlap; chain k=3 no overlap; two trees)
from transformers import AutoModelForCausalLM, LlamaConfig

PROMPTS = [[1, 17, 42, 99, 5], [300, 12, 7], list(range(40, 71)), [2, 250, 3, 77, 160, 9, 33], [64]]
NEW_TOKENS = 32
TAU_FACTOR = 4.0


def mode_name(mode: str, spec: dict) -> str:
    return " ".join([mode, *(f"{k}={v}" for k, v in spec.items())])


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, Path]:
    """A larger random Llama whose bf16 rounding matters: hidden 256, 4 layers, 4 heads over 2 KV
    heads of 64, the test vocabulary (384), initializer_range 0.05 (model_factory uses 0.2) so
    logits are flat enough for occasional near-ties yet generations don't collapse into loops.
    Its draft is the target with every matrix perturbed by 3% of its spread: it agrees with the
    target's argmax ~3/4 of the time (a layer subset of this model agrees < 1/4), so steps see
    partial acceptances, rejections and tree compaction alike."""
    root = tmp_path_factory.mktemp("wide")
    target, draft = root / "target", root / "draft"
    target.mkdir()
    tok = make_tokenizer(target)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                      tie_word_embeddings=False, initializer_range=0.05,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(5)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(target)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for w in model.parameters():
            if w.ndim == 2:
                w.add_(torch.randn(w.shape, generator=gen) * w.std() * 0.03)
    model.save_pretrained(draft)
    tok.save_pretrained(draft)
    return target, draft


def generate_all(cluster, jobs, concurrent: bool) -> dict:
    """jobs: [(prompt index, mode, spec)] -> {(prompt index, mode name): (ids, final)}."""
    def one(job):
        p, mode, spec = job
        return cluster.generate(PROMPTS[p], NEW_TOKENS, mode, timeout=300, **spec)
    if concurrent:
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(one, jobs))
    else:
        results = [one(j) for j in jobs]
    return {(p, mode_name(mode, spec)): r for (p, mode, spec), r in zip(jobs, results)}


def check_half_precision_cluster(label: str, cluster, target: Path, dtype: torch.dtype, device: str = "cuda") -> None:
    """Run every mode solo and batched on `cluster`, judge (A) and (B), publish the report, assert."""
    jobs = [(p, mode, spec) for p in range(len(PROMPTS)) for mode, spec in MODES]
    names = [mode_name(mode, spec) for mode, spec in MODES]
    assert names[0] == "off"
    solo = generate_all(cluster, jobs, concurrent=False)
    # the same requests all at once: batched steps, ragged trees and chains in one forward
    batched = generate_all(cluster, jobs, concurrent=True)

    stats = {}
    for (p, name), (ids, final) in [*solo.items(), *batched.items()]:
        assert len(ids) == NEW_TOKENS and final.completion_tokens == NEW_TOKENS, (p, name)
        assert final.finish_reason == "length" and final.stats.mode == name.split()[0], (p, name)
        acc = stats.setdefault(name, [0, 0])
        acc[0] += final.stats.drafted
        acc[1] += final.stats.accepted

    ref32 = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()  # fp32 on the CPU
    ref32.generation_config.eos_token_id = None
    half = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()  # for E_i only
    hf32 = {}
    for p, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = ref32.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0)
        hf32[p] = out[0, len(prompt):].tolist()

    # every distinct (prompt, sequence): fp32 teacher-forced logits, and the half-precision noise
    # E_i along it (the largest |HF half - fp32| logit error after each prefix); tau_i = F x E_i
    seqs = {(p, tuple(ids)) for (p, _), (ids, _) in [*solo.items(), *batched.items()]}
    seqs |= {(p, tuple(ids)) for p, ids in hf32.items()}
    logits32, tau = {}, {}
    for p, ids in sorted(seqs):
        logits32[p, ids] = teacher_forced_logits(ref32, PROMPTS[p], list(ids))
        noise = (teacher_forced_logits(half, PROMPTS[p], list(ids)) - logits32[p, ids]).abs().amax(-1)
        tau[p, ids] = TAU_FACTOR * noise

    # (B) first divergences: off against HF fp32 greedy; every mode (solo and batched) against off
    rows = []
    for p in range(len(PROMPTS)):
        off, ref = solo[p, "off"][0], tuple(hf32[p])
        rows.append(judge_divergence(label, p, "off vs hf-fp32", hf32[p], off, logits32[p, ref], tau[p, ref]))
        for name in names:
            for how, results in (("", solo), (" (batched)", batched)):
                if name == "off" and how == "":
                    continue
                rows.append(judge_divergence(label, p, name + how, off, results[p, name][0],
                                             logits32[p, tuple(off)], tau[p, tuple(off)]))

    # (A) every emitted token of every mode, along its own sequence
    violations, lines, headroom = [], [], 0.0
    for how, results in (("solo", solo), ("batched", batched)):
        for (p, name), (ids, _) in results.items():
            g, t = gaps(logits32[p, tuple(ids)], ids), tau[p, tuple(ids)]
            headroom = max(headroom, float((g / t).max()) * TAU_FACTOR)
            for i in (g > t).nonzero()[:, 0].tolist():
                violations.append(f"{how} prompt {p} {name}: token {i} = {ids[i]} is {float(g[i]):.4f} "
                                  f"below the fp32 max (tau {float(t[i]):.4f})")
            lines.append(f"{how:7s} prompt {p} {name:<40} tokens != fp32 argmax: {int((g > 0).sum()):2d}, "
                         f"largest gap {float(g.max()):.4f}")

    all_tau = torch.cat(list(tau.values()))
    margins = torch.cat([logits32[k].topk(2, -1).values.diff(dim=-1).abs()[:, 0] for k in tau])
    spread = torch.cat([logits32[k].std(-1) for k in tau])
    summary = [
        f"{label}: {dtype}; tau_i = {TAU_FACTOR} x E_i, E_i = max |HF {dtype} - fp32| logit error after "
        f"the same prefix: tau median {float(all_tau.median()):.4f}, max {float(all_tau.max()):.4f} "
        f"(median tau_i / fp32 logit std {float((all_tau / spread).median()):.3f})",
        f"fp32 top-2 margin median {float(margins.median()):.4f}; positions where a wrong second-best "
        f"token would be excused (top-2 margin <= tau_i): {float((margins <= all_tau).double().mean()):.1%}",
        f"largest emitted gap / E_i over all tokens of all modes: {headroom:.2f} (fails above {TAU_FACTOR})",
        "drafted/accepted per mode (solo + batched): "
        + "; ".join(f"{m}: {d}/{a}" for m, (d, a) in stats.items() if not m.startswith("off")),
    ]
    diverged = [r for r in rows if r.index is not None]
    summary.append(f"{len(diverged)} of {len(rows)} comparisons diverge; {sum(not r.ok for r in rows)} beyond tau")
    publish(f"e2e_{label}", "\n".join([*summary, "", table(rows), "", *lines,
                                       *(["", "VIOLATIONS:", *violations] if violations else [])]))

    bad = [r for r in rows if not r.ok]
    assert not bad, "divergences that are not near-ties:\n" + table(bad)
    assert not violations, "\n".join(violations[:20])
    for m, (drafted, accepted) in stats.items():   # speculation really ran, in every mode
        if not m.startswith("off"):
            assert drafted > 0 and accepted > 0, (m, drafted, accepted)
