"""`specdec train-drafter`: the training-time-test unroll computes what the serving head computes
when its earlier drafts were accepted; training on the target's own answers raises acceptance;
the draft vocabulary keeps the most frequent tokens; the prompt set's held-out split shares no
subject with training; the saved head loads in the published layout and reports its acceptance."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_eagle3_head import write_head
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdec.model.batch import ForwardBatch, causal_region
from specdec.model.eagle3 import load_eagle3
from specdec.model.kv_cache import KVCache
from specdec.model.spec import ModelSpec
from specdec.train import distill, trainer
from specdec.train.cli import add_arguments, config_from_args
from specdec.train.distill import Sample, clean_question, self_distill, self_instruct
from specdec.train.prompts import TOPICS, _items, build_prompts
from specdec.train.trainer import TrainDrafterConfig, _fit, _new_head, evaluate
from specdec.train.ttt import Labels, chain_stats, ttt_forward, ttt_loss
from specdec.train.vocab import select_draft_vocab


def _serve_chain(head, embeds, aux, root: int, steps: int) -> list[torch.Tensor]:
    """The serving path: real pairs 0..root through the KV cache, then drafts fed the head's own
    output at positions root+1.. with the (accepted) next tokens -> logits of each draft step."""
    s = head.spec.layer
    cache = KVCache(1, 2, 64, s.num_kv_heads, s.head_dim, embeds.dtype, torch.device("cpu"))
    n = root + 1
    pos = torch.arange(n)[None]
    batch = ForwardBatch.build(torch.zeros_like(pos), pos, torch.tensor([1]), pos, torch.tensor([0]),
                               causal_region(torch.tensor([n]), n))
    logits, out = head(batch, cache, embeds[:, 1:n + 1], aux[:, :n], from_target=True)
    got, hidden = [logits[0, -1]], out[:, -1:]
    for j in range(1, steps):
        p = torch.tensor([[root + j]])
        batch = ForwardBatch.build(p, p, torch.tensor([1]), p, torch.tensor([root + j]),
                                   causal_region(torch.tensor([1]), 1))
        logits, hidden = head(batch, cache, embeds[:, root + 1 + j:root + 2 + j], hidden, from_target=False)
        got.append(logits[0, -1])
    return got


def test_training_unroll_equals_serving_head(checkpoints, tmp_path):
    target_dir = checkpoints["llama-gqa"]
    write_head(target_dir, tmp_path / "head", seed=3)
    target = ModelSpec.from_pretrained(target_dir)
    head = load_eagle3(tmp_path / "head", target, torch.float64, torch.device("cpu"))
    torch.manual_seed(0)
    t_len, h = 12, target.hidden_size
    embeds = torch.randn(1, t_len, h, dtype=torch.float64)
    aux = torch.randn(1, t_len, 3 * h, dtype=torch.float64)
    unrolled = ttt_forward(head, embeds, aux, steps=4)
    for root in (0, 4, 7):
        for j, want in enumerate(_serve_chain(head, embeds, aux, root, steps=4)):
            torch.testing.assert_close(unrolled[j][0, root], want, rtol=0, atol=1e-9,
                                       msg=f"draft step {j} from root {root}")


class _IdentityVocabHead:
    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


def test_chain_stats_from_every_root_and_along_greedy_decoding():
    """Hand-worked: 8 tokens, positions 0..6 learned (7 has no successor), chains of 2.
    Right drafts (1 = the target's token): draft 1 from roots 0..5: 1 1 0 1 1 1; draft 2: 1 0 1 1 0 -.
    Every root: 5 of 6 first drafts, 2 of the 4 second drafts reachable -> 1 + 7/6.
    Decoding: root 0 accepts 2 -> root 3 accepts 2 -> root 6 has nothing left to draft -> 1 + 4/2."""
    t_len, vocab, wrong = 8, 10, 9
    next_id = torch.arange(t_len)[None]                           # labels: any distinct ids
    learn = (torch.arange(t_len) < t_len - 1)[None]
    rights = [[1, 1, 0, 1, 1, 1, 0], [1, 0, 1, 1, 0, 0]]
    logits = []
    for j, right in enumerate(rights):
        guess = torch.tensor([next_id[0, t + 1 + j].item() if r else wrong for t, r in enumerate(right)])
        logits.append(torch.nn.functional.one_hot(guess, vocab).float()[None])    # [1, T - 1 - j, V]
    labels = Labels(torch.zeros(1, t_len, vocab), next_id, learn, torch.ones_like(learn))
    stats = chain_stats(_IdentityVocabHead(), logits, labels)
    assert (stats.tried, stats.accepted, stats.roots) == ([6, 4], [5, 2], 6)
    assert stats.mean_accepted_length() == pytest.approx(1 + 7 / 6)
    assert (stats.decode_steps, stats.decode_accepted, stats.decode_first_right) == (2, 4, 2)
    assert stats.decode_mean_accepted_length() == 3.0
    learn[0, :2] = False                                         # a prompt of 3 tokens: decoding starts at root 2
    stats = chain_stats(_IdentityVocabHead(), logits, labels)   # root 2 misses, 3 accepts 2, then 6
    assert (stats.decode_steps, stats.decode_accepted, stats.decode_first_right) == (2, 2, 1)


def test_root_weight_weighs_the_roots_right_after_a_missed_first_draft():
    """Hand-worked, one step: 4 learned roots, each with a cross-entropy of its own; the first draft
    from root 1 misses, so root 2 (where decoding would start its next step) weighs 1 + w."""
    t_len, vocab = 6, 4
    labels_at = [0, 1, 2, 3, 0, 1]                                   # the target's token after each position
    probs = torch.nn.functional.one_hot(torch.tensor(labels_at), vocab).float()[None]
    learn = torch.tensor([[True] * 5 + [False]])
    labels = Labels(probs, torch.tensor([labels_at]), learn, torch.ones_like(learn))
    guesses = [labels_at[t + 1] for t in range(t_len - 1)] + [0]     # root t's first draft: right ...
    guesses[1] = (labels_at[2] + 1) % vocab                          # ... but root 1's
    logits = torch.full((1, t_len, vocab), -2.0)
    for t, g in enumerate(guesses):
        logits[0, t, g] = 2.0 + 0.1 * t                              # a distinct loss per root
    ce = -torch.log_softmax(logits[0, :t_len - 1], -1)[torch.arange(t_len - 1), torch.tensor(labels_at[1:])]
    usable = learn[0, 1:].float()                                    # roots 0..3 (root 4's label is not learned)
    for w in (0.0, 2.0):
        weight = torch.ones(t_len - 1)
        weight[2] += w
        want = (ce * usable * weight).sum() / (usable * weight).sum()
        got, _ = ttt_loss([logits], labels, decay=1.0, root_weight=w)
        torch.testing.assert_close(got, want)


def test_sampled_answers_add_distinct_reproducible_contexts(checkpoints):
    target_dir = checkpoints["llama-gqa"]
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    prompts = build_prompts(0).train[:6]
    greedy = self_distill(model, tok, prompts, 12, 4)
    more = self_distill(model, tok, prompts, 12, 4, samples_per_prompt=3, temperature=1.0, seed=5)
    assert self_distill(model, tok, prompts, 12, 4, samples_per_prompt=3, temperature=1.0, seed=5) == more
    assert self_distill(model, tok, prompts, 12, 4, samples_per_prompt=3, temperature=1.0, seed=6) != more
    assert len(greedy) == len(prompts) and len(prompts) < len(more) <= 3 * len(prompts)
    by_prompt: dict[tuple, list[tuple]] = {}
    for s in more:
        by_prompt.setdefault(tuple(s.ids[:s.answer_start]), []).append(tuple(s.ids))
    for g in greedy:   # each prompt's greedy answer first, then distinct sampled ones
        got = by_prompt[tuple(g.ids[:g.answer_start])]
        assert got[0] == tuple(g.ids) and len(set(got)) == len(got)


def test_draft_vocab_keeps_the_most_frequent_tokens():
    samples = [Sample([9, 9, 5, 5, 5, 7, 2], 2), Sample([1, 5, 7, 3], 1)]   # answers: 5 5 5 7 2 | 5 7 3
    vocab = select_draft_vocab(samples, vocab_size=12, size=3, always=[11])
    assert vocab.target_ids.tolist() == [5, 7, 11]      # EOS forced in; 5 and 7 are the most frequent
    assert (torch.arange(3) + vocab.d2t).tolist() == [5, 7, 11]
    assert vocab.t2d(12).nonzero()[:, 0].tolist() == [5, 7, 11]
    assert vocab.coverage == pytest.approx(6 / 8)
    assert select_draft_vocab(samples, vocab_size=12, size=12, always=[]).target_ids.tolist() == list(range(12))


def test_self_instruct_keeps_the_question_and_drops_replies():
    assert clean_question('A curious person might ask: "How do black holes form?" It is a good one.') == \
        "How do black holes form?"
    assert clean_question("Question: Why is the sky blue?") == "Why is the sky blue?"
    assert clean_question("How do volcanoes erupt?\nThey erupt when magma rises.") == "How do volcanoes erupt?"
    assert clean_question("I'm ready to assist. What's your request?") is None    # answered as the assistant
    assert clean_question("Photosynthesis turns light into sugar.") is None       # not a question
    assert clean_question("Why?") is None                                         # too short to teach anything


def test_self_instruct_samples_its_questions(checkpoints, monkeypatch):
    """Greedy, a request asked twice writes the same question twice, so the questions stop at the
    distinct requests (templates x topics); sampled (the default), repeats bring new ones, the same
    seed the same ones."""
    target_dir = checkpoints["llama-gqa"]
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    monkeypatch.setattr(distill, "clean_question", lambda text: text or None)   # random weights write no questions
    requests = ["Write one question about cats.", "Write one question about dogs."] * 4
    assert len(self_instruct(model, tok, requests, 3, temperature=0.0)) <= 2
    sampled = self_instruct(model, tok, requests, 3, temperature=1.0, seed=1)
    assert len(sampled) > 2
    assert self_instruct(model, tok, requests, 3, temperature=1.0, seed=1) == sampled
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = ["--out", "x"]
    assert config_from_args(parser.parse_args(args), target_dir).self_instruct_temperature == 0.8
    greedy = parser.parse_args(args + ["--self-instruct-temperature", "0"])
    assert config_from_args(greedy, target_dir).self_instruct_temperature == 0.0
    asked = []   # and training asks for its questions at the configured temperature
    monkeypatch.setattr(trainer, "self_instruct", lambda *a: asked.append(a[3:]) or [])
    trainer._sequences(TrainDrafterConfig(target_dir, Path("x"), prompts=0, heldout=0, self_instruct=3,
                                          self_instruct_temperature=0.7, seed=4), model, tok)
    assert asked == [(TrainDrafterConfig.gen_batch, 0.7, 4)]


def test_prompt_set_is_diverse_reproducible_and_held_out_by_subject():
    a, b = build_prompts(seed=0), build_prompts(seed=0)
    assert a.train == b.train and a.heldout == b.heldout
    assert build_prompts(seed=1).train != a.train
    assert len(a.train) > 3000 and len(a.heldout) > 300 and len(set(a.train)) == len(a.train)
    topics = _items(TOPICS)

    def mentions(prompt: str, topic: str) -> bool:   # as a whole phrase, not inside a longer topic's name
        return re.search(rf"\b{re.escape(topic)}\b", prompt) is not None and not any(
            u != topic and topic in u and u in prompt for u in topics)

    held_topics = [t for t in topics if any(mentions(p, t) for p in a.heldout)]
    assert len(held_topics) > 10
    about = [p for p in a.train if '"' not in p]   # (rewrite tasks quote sentences, they are not about a topic)
    for t in held_topics:   # no training prompt is about a held-out subject
        assert not any(mentions(p, t) for p in about), t
    kinds = {"code": "function", "poem": "poem", "list": "list", "math": "Solve for x", "dialogue": "dialogue"}
    for kind, marker in kinds.items():
        assert any(marker in p for p in a.train), kind


def test_training_on_its_own_answers_raises_acceptance(checkpoints, tmp_path):
    target_dir = checkpoints["llama-gqa"]
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)
    torch.manual_seed(0)
    train = self_distill(model, tok, build_prompts(0).train[:16], 32, 16)
    spec = ModelSpec.from_pretrained(target_dir)
    vocab = select_draft_vocab(train, spec.vocab_size, 512, [tok.eos_token_id])
    cfg = TrainDrafterConfig(target_dir, tmp_path / "head", epochs=150, batch_tokens=2048, lr=3e-3, ttt_steps=3,
                             aux_layers=(1, 2, 3))
    head = _new_head(cfg, spec, vocab, model)
    cpu = torch.device("cpu")
    before = evaluate(head, model, train, vocab, 3, 2048, 1024, cpu)
    _fit(cfg, head, model, train, vocab, cpu)
    after = evaluate(head, model, train, vocab, 3, 2048, 1024, cpu)
    # A random target is hard to predict; what the head learned shows on the sequences it saw.
    assert after.per_position()[0] > before.per_position()[0] + 0.2
    assert after.mean_accepted_length() > before.mean_accepted_length() + 0.2


def test_cli_trains_and_saves_a_loadable_head(checkpoints, tmp_path):
    target_dir = checkpoints["llama-gqa"]
    out = tmp_path / "head"
    cmd = [sys.executable, "-m", "specdec.cli", "train-drafter", "--target", str(target_dir), "--out", str(out),
           "--prompts", "12", "--self-instruct", "4", "--heldout", "4", "--max-new-tokens", "16",
           "--draft-vocab", "64", "--epochs", "2", "--eval-k", "3", "--aux-layers", "1,2,3",
           "--save-data", str(tmp_path / "data.pt")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "position 3:" in done.stdout and "along greedy decoding" in done.stdout and "sha256" in done.stdout
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 64 and cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    head = load_eagle3(out, ModelSpec.from_pretrained(target_dir), torch.float32, torch.device("cpu"))
    assert head.spec.aux_layers == (1, 2, 3) and int(head.t2d.sum()) == 64
    report = json.loads((out / "training_report.json").read_text())["report"]
    assert len(report["heldout_acceptance"]) == 3 and report["heldout_sequences"] == 4
    # the saved sequences train again without generating (--data), to the same head: the two-stage
    # recipe the shipped head was made by is the one command
    again = subprocess.run(cmd[:cmd.index("--out")] + ["--out", str(tmp_path / "again"), "--data",
                                                       str(tmp_path / "data.pt"), "--epochs", "2", "--draft-vocab",
                                                       "64", "--aux-layers", "1,2,3", "--eval-k", "3"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "answering prompts" not in again.stderr
    first, second = (load_file(str(d / "model.safetensors")) for d in (out, tmp_path / "again"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_eval_head_script_reports_both_figures(checkpoints, tmp_path):
    """scripts/eval_head.py on a tiny target and a random head: every-root and decoding figures,
    consistent with each other (a chain of 2 commits 1..3 tokens a step)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import eval_head

    target = checkpoints["llama-gqa"]
    write_head(target, tmp_path / "head", seed=1)
    got = eval_head.main(["--target", str(target), "--head", str(tmp_path / "head"), "--num-prompts", "3",
                          "--max-new-tokens", "12", "--k", "2", "--json"])
    assert got["prompts"] == 3 and got["answer_tokens"] > 0 and len(got["per_position_every_root"]) == 2
    assert got["decode_steps"] > 0 and 0 <= got["first_draft_right_decoding"] <= 1
    for key in ("mean_accepted_length_every_root", "mean_accepted_length_decoding"):
        assert 1.0 <= got[key] <= 3.0, got


def test_a_time_budget_cuts_the_steps_and_fits_the_schedule(checkpoints, tmp_path, monkeypatch):
    """--max-train-seconds: the step rate read between steps 10 and 30 sets how many steps fit the
    budget (a clock that ticks one second per reading: 20 steps a second, 2 s gone by step 30 of a
    4 s budget -> 31 + 40 steps of the 4,000 the epochs ask for), and the learning rate then ends
    its cosine at the last of them."""
    from specdec.train import trainer

    assert trainer.steps_within(10.0, 31, 4.0, 5.0, 1000) == 61
    assert trainer.steps_within(10.0, 31, 12.0, 5.0, 1000) == 31 and trainer.steps_within(1e9, 31, 1.0, 5.0, 90) == 90
    ticks = iter(range(10**6))
    monkeypatch.setattr(trainer, "_clock", lambda: float(next(ticks)))
    target_dir = checkpoints["llama-gqa"]
    tok = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval().requires_grad_(False)
    train = self_distill(model, tok, build_prompts(0).train[:4], 8, 4)
    spec = ModelSpec.from_pretrained(target_dir)
    vocab = select_draft_vocab(train, spec.vocab_size, 64, [tok.eos_token_id])
    cfg = TrainDrafterConfig(target_dir, tmp_path / "head", epochs=4000, batch_tokens=4096, ttt_steps=2,
                             aux_layers=(1, 2, 3), max_train_seconds=4.0)
    head = _new_head(cfg, spec, vocab, model)
    lrs = []
    monkeypatch.setattr(torch.optim.AdamW, "step", lambda opt, *a, **k: lrs.append(opt.param_groups[0]["lr"]))
    steps, _ = _fit(cfg, head, model, train, vocab, torch.device("cpu"))
    assert steps == len(lrs) == 71
    assert lrs[-1] < 0.01 * cfg.lr   # the cosine reached its end at the last step
