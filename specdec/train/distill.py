"""Training sequences for a draft head: the target's own greedy answers (self-distillation), or local text.

A Sample is one token sequence and where its answer starts: positions before `answer_start` are
the prompt (context only), the rest are what the head learns to draft. Self-distilled answers are
the target's greedy continuations, so during training a drafted position's input token is exactly
what the head sees at inference when its earlier drafts were accepted. Extra sampled answers per
prompt (`samples_per_prompt`, at `temperature`) add contexts the greedy path never reaches: one
prompt set then teaches several times as many distinct positions, and the labels stay the
target's own distributions wherever the context came from.

Generation is Hugging Face `generate` (batched with left padding, prompts sorted by length so
batches pad little); it is the reference the server is lossless against anyway. Sampled rounds
are seeded per batch, so a seed gives the same answers on the same machine.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm


@dataclass(frozen=True)
class Sample:
    ids: list[int]
    answer_start: int   # first answer position; 0 for plain text (every position is learned)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt as the gateway tokenizes it for apply_chat_template requests (plain text without one)."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                             tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


@torch.inference_mode()
def answers(model, tokenizer, prompts: list[list[int]], max_new_tokens: int, batch_size: int, desc: str,
            temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
    """The target's continuation of each prompt (up to and including EOS), in prompt order: greedy,
    or sampled at `temperature` (nucleus 0.95) with the generator seeded per batch from `seed`."""
    device = next(model.parameters()).device
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    continuations: list[list[int]] = [[] for _ in prompts]
    for start in tqdm(range(0, len(order), batch_size), desc=desc, unit="batch"):
        idx = order[start:start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):   # left padding: every prompt ends at the last column
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, width - len(prompts[i]):] = 1
        sample = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
        if temperature > 0:
            torch.manual_seed(seed * 1_000_003 + start)
            sample = {"do_sample": True, "temperature": temperature, "top_p": 0.95, "top_k": 0}
        out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
                             pad_token_id=pad, eos_token_id=eos, **sample)
        for row, i in enumerate(idx):
            new = out[row, width:].tolist()
            continuations[i] = new[:new.index(eos) + 1] if eos in new else new
    return continuations


def self_distill(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int,
                 samples_per_prompt: int = 1, temperature: float = 0.8, seed: int = 0) -> list[Sample]:
    """Per prompt: the greedy answer, then samples_per_prompt - 1 sampled ones (distinct from those before)."""
    prompt_ids = [chat_ids(tokenizer, p) for p in prompts]
    rounds = [answers(model, tokenizer, prompt_ids, max_new_tokens, batch_size, "answering prompts")]
    for r in range(1, samples_per_prompt):
        rounds.append(answers(model, tokenizer, prompt_ids, max_new_tokens, batch_size,
                              f"sampling answers ({r}/{samples_per_prompt - 1})", temperature, seed * 1000 + r))
    samples = []
    for i, p in enumerate(prompt_ids):
        kept = list(dict.fromkeys(tuple(round_[i]) for round_ in rounds if round_[i]))
        samples += [Sample(p + list(a), len(p)) for a in kept]
    return samples


def self_instruct(model, tokenizer, requests: list[str], batch_size: int, temperature: float = 0.0,
                  seed: int = 0) -> list[str]:
    """The target writes user prompts: its answers to `requests`, cleaned and de-duplicated.
    Greedy (temperature 0) answers each distinct request once, whatever the number of requests
    (the request templates x training topics cap the questions at a few hundred); sampled, every
    request can bring a new question. Only the questions are sampled: their answers, which the
    head learns from, are the target's own greedy ones."""
    ids = [chat_ids(tokenizer, r) for r in requests]
    written = answers(model, tokenizer, ids, 48, batch_size, "writing prompts (self-instruct)", temperature, seed)
    questions = (clean_question(tokenizer.decode(a, skip_special_tokens=True)) for a in written)
    return list(dict.fromkeys(q for q in questions if q))


def clean_question(text: str) -> str | None:
    """The question in a self-instruct answer, or None when it holds none.

    The target wraps its question in a preamble ('A curious person might ask: "..."') or answers
    it right away; keep the quoted question when there is one, else the first line, and only if it
    is a question of a sensible length.
    """
    quoted = re.search(r'"([^"\n]{12,300}\?)"', text)
    line = quoted.group(1) if quoted else text.strip().split("\n")[0].strip().strip('"')
    line = line.split(":", 1)[1].strip().strip('"') if not quoted and ":" in line else line
    if ASSISTANT_REPLY.match(line):   # the target answered as the assistant instead of writing a question
        return None
    return line if 12 <= len(line) <= 300 and line.endswith("?") else None


ASSISTANT_REPLY = re.compile(r"(I'm|I am|I |Sure|Of course|Certainly|Here|Hello|Hi\b)")
# (Left as the shipped head's data was cleaned, so TRAIN_COMMAND keeps reproducing it exactly; seen
# since in sampled questions: a leading "Question:" label kept, "What a wonderful question! ..." replies.)


def text_samples(tokenizer, files: list[Path], length: int) -> list[Sample]:
    """Local text cut into chunks of `length` tokens, every position learned."""
    ids: list[int] = []
    for f in files:
        ids.extend(tokenizer(f.read_text(errors="replace"))["input_ids"])
    return [Sample(ids[i:i + length], 0) for i in range(0, len(ids) - 1, length) if len(ids[i:i + length]) > 1]


def save_samples(path: Path, train: list[Sample], heldout: list[Sample], meta: dict) -> None:
    torch.save({"train": [(s.ids, s.answer_start) for s in train],
                "heldout": [(s.ids, s.answer_start) for s in heldout], "meta": meta}, path)


def load_samples(path: Path) -> tuple[list[Sample], list[Sample], dict]:
    raw = torch.load(path, weights_only=True)
    return [Sample(*s) for s in raw["train"]], [Sample(*s) for s in raw["heldout"]], raw["meta"]
