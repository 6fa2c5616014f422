"""`specdec train-drafter`: train an EAGLE-3 head for a target and save it in the published layout.

Steps: training sequences (the target's greedy answers to the offline prompt set, plus prompts
the target writes itself, plus any local text) -> draft vocabulary from token frequencies -> a
head initialised from the target (lm_head rows, final norm) -> epochs of training-time-test
unrolls against the target's own distributions (the target runs online, frozen: its hidden
states and logits are recomputed per batch rather than stored) -> held-out acceptance per draft
position -> config.json, model.safetensors and training_report.json.
"""

from __future__ import annotations

import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from specdec.model.eagle3 import Eagle3Head, Eagle3Spec, default_aux_layers
from specdec.model.spec import ModelSpec
from specdec.train.config import TrainDrafterConfig, TrainReport
from specdec.train.distill import Sample, load_samples, save_samples, self_distill, self_instruct, text_samples
from specdec.train.prompts import build_prompts, self_instruct_requests
from specdec.train.ttt import ChainStats, Labels, chain_stats, ttt_forward, ttt_loss
from specdec.train.vocab import DraftVocab, select_draft_vocab


def train_drafter(cfg: TrainDrafterConfig) -> TrainReport:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype).to(device).eval().requires_grad_(False)
    train, heldout = _sequences(cfg, target, tokenizer)
    tspec = ModelSpec.from_pretrained(cfg.target)
    vocab = select_draft_vocab(train, tspec.vocab_size, cfg.draft_vocab, [tokenizer.eos_token_id])
    torch.manual_seed(cfg.seed)   # sampling the answers drew from the generator: a --data run must start the same
    head = _new_head(cfg, tspec, vocab, target).to(device)
    print(f"{len(train)} training sequences ({sum(len(s.ids) for s in train)} tokens), {len(heldout)} held out; "
          f"draft vocabulary {len(vocab.target_ids)} covers {vocab.coverage:.1%} of answer tokens", flush=True)

    start = time.time()
    steps, loss = _fit(cfg, head, target, train, vocab, device)
    stats = evaluate(head, target, heldout, vocab, cfg.eval_k, cfg.batch_tokens, cfg.max_len, device)
    report = TrainReport(len(train), sum(len(s.ids) for s in train), len(heldout), len(vocab.target_ids),
                         vocab.coverage, steps, time.time() - start, loss, stats.per_position(),
                         stats.mean_accepted_length(), stats.decode_mean_accepted_length())
    save_head(head, cfg, report)
    return report


def _sequences(cfg: TrainDrafterConfig, target, tokenizer) -> tuple[list[Sample], list[Sample]]:
    if cfg.data:
        train, heldout, _ = load_samples(cfg.data)
        return train, heldout
    prompt_set = build_prompts(cfg.seed)
    prompts = prompt_set.train[:cfg.prompts] if cfg.prompts is not None else list(prompt_set.train)
    if cfg.self_instruct:
        requests = self_instruct_requests(cfg.seed, cfg.self_instruct)
        prompts += self_instruct(target, tokenizer, requests, cfg.gen_batch, cfg.self_instruct_temperature, cfg.seed)
    train = self_distill(target, tokenizer, prompts, cfg.max_new_tokens, cfg.gen_batch, cfg.samples_per_prompt,
                         cfg.temperature, cfg.seed)
    train += text_samples(tokenizer, list(cfg.text), cfg.max_len)
    heldout = self_distill(target, tokenizer, prompt_set.heldout[:cfg.heldout], cfg.max_new_tokens, cfg.gen_batch)
    if cfg.save_data:
        save_samples(cfg.save_data, train, heldout, {"target": str(cfg.target), "seed": cfg.seed})
    return train, heldout


def head_config(cfg: TrainDrafterConfig, tspec: ModelSpec, vocab: DraftVocab) -> dict:
    """The target's config as a one-layer head, in the published layout (aux ids are layer OUTPUTS)."""
    raw = json.loads((cfg.target / "config.json").read_text())
    aux = cfg.aux_layers or default_aux_layers(tspec.num_layers)
    raw.update(architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=len(vocab.target_ids),
               target_hidden_size=tspec.hidden_size, tie_word_embeddings=False,
               eagle_config={"eagle_aux_hidden_state_layer_ids": [i - 1 for i in aux]})
    return raw


def _new_head(cfg: TrainDrafterConfig, tspec: ModelSpec, vocab: DraftVocab, target) -> Eagle3Head:
    cfg.out.mkdir(parents=True, exist_ok=True)
    (cfg.out / "config.json").write_text(json.dumps(head_config(cfg, tspec, vocab), indent=2))
    spec = Eagle3Spec.from_pretrained(cfg.out, tspec)
    head = Eagle3Head(spec)
    with torch.no_grad():   # start from the target's own output layer, restricted to the draft vocabulary
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab.target_ids.to(target.device)].float())
        head.norm.weight.copy_(target.model.norm.weight.float())
        head.d2t.copy_(vocab.d2t)
        head.t2d.copy_(vocab.t2d(tspec.vocab_size))
    return head


def _batches(samples: list[Sample], batch_tokens: int, max_len: int) -> list[list[Sample]]:
    """Length-sorted groups whose padded size stays within batch_tokens (sequences cut at max_len)."""
    ordered = sorted(samples, key=lambda s: len(s.ids))
    groups: list[list[Sample]] = []
    for s in ordered:
        s = Sample(s.ids[:max_len], s.answer_start)
        if groups and (len(groups[-1]) + 1) * len(s.ids) <= batch_tokens:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups


@torch.no_grad()
def _target_pass(target, group: list[Sample], vocab: DraftVocab, aux_layers, device):
    """-> target embeddings [B, T, h], captured states [B, T, A] (fp32) and the Labels."""
    width = max(len(s.ids) for s in group)
    ids = torch.zeros(len(group), width, dtype=torch.long)
    learn = torch.zeros(len(group), width, dtype=torch.bool)
    mask = torch.zeros_like(ids)
    for row, s in enumerate(group):
        ids[row, :len(s.ids)] = torch.tensor(s.ids)
        mask[row, :len(s.ids)] = 1
        learn[row, max(s.answer_start - 1, 0):len(s.ids) - 1] = True   # p predicts token p+1, an answer token
    ids, learn, mask = ids.to(device), learn.to(device), mask.to(device)
    captured: list[torch.Tensor] = []   # Hugging Face's last hidden state is after the final norm; ours is before
    hook = target.model.norm.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        out = target(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    finally:
        hook.remove()
    states = out.hidden_states[:-1] + (captured[0],)   # [0] embeddings, [i] the input of layer i (i <= L)
    logits = out.logits
    next_id = logits.argmax(-1)
    draft_ids = vocab.target_ids.to(device)
    labels = Labels(logits[..., draft_ids].float().softmax(-1), next_id, learn,
                    torch.isin(next_id, draft_ids))
    aux = torch.cat([states[i] for i in aux_layers], dim=-1).float()
    return states[0].float(), aux, labels


RATE_STEPS = (10, 30)   # --max-train-seconds: the step rate is read between these steps (past warm-up)
_clock = time.perf_counter


def steps_within(budget: float, done: int, elapsed: float, rate: float, planned: int) -> int:
    """Steps a training run may take in all: the planned ones, or fewer where the budget left after
    `done` steps in `elapsed` seconds holds fewer at `rate` steps a second (never fewer than done)."""
    return max(done, min(planned, done + int(rate * max(0.0, budget - elapsed))))


def _fit(cfg: TrainDrafterConfig, head: Eagle3Head, target, train: list[Sample], vocab: DraftVocab,
         device) -> tuple[int, float]:
    groups = _batches(train, cfg.batch_tokens, cfg.max_len)
    planned = max(1, int(len(groups) * cfg.epochs))
    total = [planned]   # lowered once the step rate is known, under --max-train-seconds (the cosine follows)
    params = list(head.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warmup = max(1, planned // 30)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, total[0]) / total[0])))
    rng = random.Random(cfg.seed)
    order: list[int] = []
    head.train()
    bar = tqdm(total=planned, desc="training head", unit="step")
    loss_now = 0.0
    started, marks = _clock(), {}
    step = -1
    while step + 1 < total[0]:
        step += 1
        bar.update()
        if not order:
            order = list(range(len(groups)))
            rng.shuffle(order)
        embeds, aux, labels = _target_pass(target, groups[order.pop()], vocab, head.spec.aux_layers, device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = ttt_forward(head, embeds, aux, cfg.ttt_steps)
        loss, per_step = ttt_loss(logits, labels, cfg.decay, cfg.root_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        sched.step()
        if step % 10 == 0 or step == total[0] - 1:   # host reads only when the bar is updated
            loss_now = loss.item()
            acc = chain_stats(head, logits[:1], labels).per_position()[0]
            bar.set_postfix(loss=f"{loss_now:.3f}", first=f"{per_step[0].item():.3f}", acc0=f"{acc:.2f}")
        if cfg.max_train_seconds is not None and step in RATE_STEPS:
            marks[step] = _clock()   # just after a host read: the device has caught up
            if len(marks) == 2:
                lo, hi = RATE_STEPS
                rate = (hi - lo) / max(marks[hi] - marks[lo], 1e-9)
                total[0] = steps_within(cfg.max_train_seconds, hi + 1, marks[hi] - started, rate, planned)
                if total[0] < planned:
                    bar.total = total[0]
                    print(f"time budget {cfg.max_train_seconds:.0f} s: {total[0]} of {planned} steps "
                          f"({rate:.1f} steps/s)", flush=True)
    bar.close()
    head.eval()
    return total[0], loss_now


@torch.no_grad()
def evaluate(head: Eagle3Head, target, samples: list[Sample], vocab: DraftVocab, k: int, batch_tokens: int,
             max_len: int, device, wire: Callable[[torch.Tensor], torch.Tensor] | None = None) -> ChainStats:
    """Greedy chain acceptance of k drafts from every root of the samples' answers. wire: what the
    target's hidden states [B, T, A] go through before the head reads them (e.g. fp8 packing)."""
    stats = ChainStats([0] * k, [0] * k)
    for group in tqdm(_batches(samples, batch_tokens, max_len), desc="held-out acceptance", unit="batch"):
        embeds, aux, labels = _target_pass(target, group, vocab, head.spec.aux_layers, device)
        aux = aux if wire is None else wire(aux)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = ttt_forward(head, embeds, aux, k)
        stats.add(chain_stats(head, logits, labels))
    return stats


def save_head(head: Eagle3Head, cfg: TrainDrafterConfig, report: TrainReport) -> None:
    """model.safetensors in the published layout (weights in save_dtype; d2t long, t2d bool) + the report."""
    dtype = getattr(torch, cfg.save_dtype)
    state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
             for k, v in head.state_dict().items()}
    save_file(state, str(cfg.out / "model.safetensors"))
    config = {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()}
    config["text"] = [str(p) for p in cfg.text]
    (cfg.out / "training_report.json").write_text(json.dumps({"config": config, "report": asdict(report)}, indent=2))
