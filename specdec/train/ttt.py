"""Training-time test: an EAGLE-3 head unrolled over several draft positions, differentiably.

Index conventions (t runs over a sequence of T tokens x_0..x_T-1 with target states H_t):
  step 0 at index t: token x_t+1 with fc(H_t), head position t     -> predicts the token after x_t+1
  step j at index t: token x_t+1+j with the head's own step j-1 output at t, head position t+j
                     -> predicts the token after x_t+1+j
so step j's label is the target at position t+1+j. A step-j query at index t attends to the
step-0 keys at indices <= t (the real pairs the serving head holds in its KV cache) and to the
step-1..j keys at index t itself (its own earlier drafts from that root): exactly what the
serving engine computes when drafts 0..j-1 from root t were accepted. Feeding the head its own
hidden states at later positions is what lets it keep drafting when the target's are missing.

The head's serving forward (Eagle3Head.forward) works on the KV cache under inference mode; this
one reuses the same submodules with plain attention so gradients flow.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from specdec.model.eagle3 import Eagle3Head
from specdec.model.layers import apply_rotary


def ttt_forward(head: Eagle3Head, embeds: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """embeds [B, T, h] (target embeddings of x_0..x_T-1), aux [B, T, A] (captured target states)
    -> per step j, draft logits [B, T, Vd]; entry t predicts the token after position t+1+j."""
    b, t_len, _ = embeds.shape
    layer, attn = head.midlayer, head.midlayer.self_attn
    hidden = head.fc(aux)                                                   # [B, T, h]
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    positions = torch.arange(t_len, device=embeds.device).expand(b, t_len)
    logits = []
    for j in range(steps):
        token_embeds = F.pad(embeds[:, 1 + j:], (0, 0, 0, 1 + j))           # x_t+1+j at index t
        normed = layer.hidden_norm(hidden)
        residual = normed if head.spec.norm_before_residual else hidden
        x = torch.cat([layer.input_layernorm(token_embeds), normed], dim=-1)     # [B, T, 2h]
        q = attn.q_proj(x).view(b, t_len, attn.num_heads, attn.head_dim)
        k = attn.k_proj(x).view(b, t_len, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(x).view(b, t_len, attn.num_kv_heads, attn.head_dim)
        cos, sin = head.rotary(positions + j, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        keys.append(k)
        values.append(v)
        a = _root_attention(q, keys, values)                                # [B, T, H, D]
        h = residual + attn.o_proj(a.reshape(b, t_len, -1))
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        logits.append(head.lm_head(head.norm(hidden)))
    return logits


def _root_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """q [B, T, H, D]; keys/values of steps 0..j, each [B, T, KV, D] -> [B, T, H, D]."""
    b, t_len, heads, d = q.shape
    rep = heads // keys[0].shape[2]
    scale = d ** -0.5
    qh = q.transpose(1, 2)                                                  # [B, H, T, D]
    k0 = keys[0].repeat_interleave(rep, 2).transpose(1, 2)
    v0 = values[0].repeat_interleave(rep, 2).transpose(1, 2)
    wide = torch.promote_types(q.dtype, torch.float32)   # softmax statistics in fp32 at least
    causal = torch.ones(t_len, t_len, dtype=torch.bool, device=q.device).tril()
    scores = [(qh @ k0.transpose(-1, -2)).to(wide).masked_fill(~causal, float("-inf")) * scale]   # [B, H, T, T]
    own = [(q * k.repeat_interleave(rep, 2)).sum(-1).transpose(1, 2).to(wide) * scale for k in keys[1:]]
    if own:
        scores.append(torch.stack(own, dim=-1))                              # [B, H, T, j]
    probs = torch.cat(scores, dim=-1).softmax(-1).to(q.dtype)
    out = probs[..., :t_len] @ v0                                            # [B, H, T, D]
    for i, v in enumerate(values[1:]):
        out = out + probs[..., t_len + i, None] * v.repeat_interleave(rep, 2).transpose(1, 2)
    return out.transpose(1, 2)


@dataclass
class Labels:
    """The target at each position p of a batch (predicting token p+1)."""
    probs: torch.Tensor      # [B, T, Vd] target distribution renormalised over the draft vocabulary
    next_id: torch.Tensor    # [B, T] the target's argmax over its whole vocabulary
    learn: torch.Tensor      # [B, T] bool: the token after p is an answer token
    in_vocab: torch.Tensor   # [B, T] bool: next_id is in the draft vocabulary


def ttt_loss(logits: list[torch.Tensor], labels: Labels, decay: float,
             root_weight: float = 0.0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Soft cross-entropy to the target per step, weighted decay**j -> (loss, per-step losses, detached).
    Positions whose target token the draft vocabulary cannot express teach nothing (masked).

    root_weight > 0 weighs the chains from root t by 1 + root_weight when the head's first draft
    from root t - 1 (its guess at x_t+1) missed: greedy decoding starts its next step right after
    a miss far more often than at a random position, and those roots are the harder ones
    (scripts/eval_head.py measures both)."""
    total = logits[0].new_zeros((), dtype=torch.float32)
    per_step = []
    usable = (labels.learn & labels.in_vocab).float()                      # [B, T]
    weight = torch.ones_like(usable)
    if root_weight:
        # logits[0][:, t - 1] drafts the token at position t + 1, whose label is labels at p = t
        with torch.no_grad():
            guess = logits[0].argmax(-1)                                   # [B, T] draft-vocabulary ids
            right = (guess[:, :-1] == labels.probs[:, 1:].argmax(-1)) & labels.in_vocab[:, 1:]
            weight[:, 1:] += root_weight * (~right).float()
    for j, lg in enumerate(logits):
        n = lg.shape[1] - 1 - j
        if n <= 0:
            break
        mask = usable[:, 1 + j:] * weight[:, :n]
        ce = -(labels.probs[:, 1 + j:] * F.log_softmax(lg[:, :n].float(), dim=-1)).sum(-1)
        step = (ce * mask).sum() / mask.sum().clamp(min=1.0)
        total = total + decay ** j * step
        per_step.append(step.detach())   # read only when logged: no host sync per step
    return total, per_step


@dataclass
class ChainStats:
    """Greedy acceptance from every root: tried[j] roots reached draft j, accepted[j] of them got it
    right; and along the roots greedy decoding visits (decode_steps steps, decode_accepted drafts)."""
    tried: list[int]
    accepted: list[int]
    roots: int = 0
    decode_steps: int = 0
    decode_accepted: int = 0
    decode_first_right: int = 0   # decoding steps whose first draft was right

    def add(self, other: ChainStats) -> None:
        self.tried = [a + b for a, b in zip(self.tried, other.tried)]
        self.accepted = [a + b for a, b in zip(self.accepted, other.accepted)]
        self.roots += other.roots
        self.decode_steps += other.decode_steps
        self.decode_accepted += other.decode_accepted
        self.decode_first_right += other.decode_first_right

    def per_position(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepted, self.tried)]

    def mean_accepted_length(self) -> float:
        """1 + accepted drafts per root: the expected tokens per verify step from a random root."""
        return 1.0 + sum(self.accepted) / max(self.roots, 1)

    def decode_mean_accepted_length(self) -> float:
        """Tokens per verify step as serving sees them: each step's root is the token after the
        last step's accepted drafts, which follows a miss far more often than a random root does,
        and those roots are harder (the shipped head's first draft: right at 47% of them, 54% of all)."""
        return 1.0 + self.decode_accepted / max(self.decode_steps, 1)


@torch.no_grad()
def chain_stats(head: Eagle3Head, logits: list[torch.Tensor], labels: Labels) -> ChainStats:
    """Teacher-forced chains: draft j from root t counts only if drafts 0..j-1 were all right (then
    its inputs are what serving would feed it); out-of-vocabulary target tokens count as misses."""
    t_len = labels.learn.shape[1]
    roots = F.pad(labels.learn[:, 1:], (0, 1))       # index t whose first label (p = t+1) is learned
    stats = ChainStats([0] * len(logits), [0] * len(logits), int(roots.sum()))
    alive = roots
    runs = torch.zeros_like(labels.next_id)          # [B, T] drafts right in a row from root t
    for j, lg in enumerate(logits):
        n = t_len - 1 - j
        if n <= 0:
            break
        guess = head.to_target_ids(lg[:, :n].argmax(-1))
        right = F.pad((guess == labels.next_id[:, 1 + j:]) & labels.learn[:, 1 + j:], (0, 1 + j))
        alive = alive & F.pad(labels.learn[:, 1 + j:], (0, 1 + j))
        stats.tried[j] = int(alive.sum())
        alive = alive & right
        stats.accepted[j] = int(alive.sum())
        runs += alive
    stats.decode_steps, stats.decode_accepted, stats.decode_first_right = _decode_walk(roots, runs, labels.learn)
    return stats


def _decode_walk(roots: torch.Tensor, runs: torch.Tensor, learn: torch.Tensor) -> tuple[int, int, int]:
    """roots, learn [B, T] bool; runs [B, T] -> (steps, accepted drafts, steps with the first draft
    right) of greedy decoding: the first root is the first learned index (the prefill's token: for
    a prompt of P tokens, x_P with the target state of P - 1), and a step that accepts m drafts
    moves the root on by m + 1."""
    b, t_len = roots.shape
    rows = torch.arange(b, device=roots.device)
    at = learn.int().argmax(1)
    live = learn.any(1)
    steps = accepted = first = 0
    while True:
        idx = at.clamp(max=t_len - 1)
        live = live & (at < t_len) & roots[rows, idx]
        if not bool(live.any()):
            return steps, accepted, first
        run = runs[rows, idx] * live
        steps += int(live.sum())
        accepted += int(run.sum())
        first += int((run > 0).sum())
        at = at + run + 1
