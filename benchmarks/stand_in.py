"""Stand-in verifier and drafter services: the real servicers, step streams and engine thread, over
engines that sleep a modelled step time instead of running a model. They measure the gateway and
the transport alone, at any concurrency, on any machine (`scripts/bench_gateway.py`).

The "target" is a fixed function of the context: next(tokens) depends on the last token and the
length. The drafter proposes that function's tokens, each kept with probability a (a seeded draw
per sequence and position, as the controlled-acceptance drafter does), otherwise a wrong one; a
tree is that chain plus wrong siblings up to its budget (its cost, without a tree's gain). The
verifier walks each draft tree against the function, so verdicts and drafts are consistent and a
request's output is the same in every mode. A step sleeps (releasing the GIL, as a GPU wait does):

    verifier: base + per_row x (verified rows + prompt tokens) [+ prompt, if it takes in a prompt]
    drafter:  base + per_row x (drafted nodes + appended tokens) [+ prompt, if it opens a sequence]

With --aux-width W the verifier sends W bf16 values per committed position (an EAGLE-3 target's
hidden states; with --hidden-states-fp8, packed as the real verifier packs them) and both report
the same aux layers, so the gateway forwards them to the drafter.

    python -m benchmarks.stand_in --role verifier --listen 127.0.0.1:50061 --base-ms 8 --per-row-ms 0.01
"""

from __future__ import annotations

import argparse
import hashlib
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from drafter_svc.types import ChainShape, Draft, DrafterStep, DrafterStepResult
from specdec.cost_profile import (AUTO_CHAIN_KS, AUTO_TREES, VERIFY_WIDTHS, StepCost, chain_shape, predraft_shape,
                                  tree_shape)
from specdec.draft_tree import DraftTree
from specdec.env import env_flag
from specdec.errors import SequenceError
from specdec.log import configure_logging
from specdec.malloc_tuning import keep_freed_memory
from specdec.rpc import common_pb2, drafter_pb2, drafter_pb2_grpc, verifier_pb2, verifier_pb2_grpc
from specdec.serving import run, serve
from specdec.sequence_table import SequenceTable
from verifier_svc.types import Verdict, VerifierStep, VerifierStepResult

AUX_LAYERS = (2, 16, 29)   # reported when --aux-width is set; any fixed ids do
FIRST_ID = 3               # stand-in tokens avoid the tokenizer's specials (<s>, </s>, ...)
PROFILE_BATCHES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class StepTime:
    base: float       # seconds per step
    per_row: float    # seconds per token row the step computes
    prompt: float = 0.0   # seconds more in a step that takes in a prompt (its forward apart)

    def sleep(self, rows: int, prompts: bool = False) -> float:
        seconds = self.base + self.per_row * rows + self.prompt * prompts
        time.sleep(seconds)
        return seconds


def next_token(tokens: list[int], vocab: int) -> int:
    """The stand-in target's greedy token after `tokens`."""
    return FIRST_ID + (tokens[-1] * 31 + len(tokens) * 17) % (vocab - FIRST_ID)


def kept(seq_id: str, position: int, acceptance: float) -> bool:
    """Whether the drafter proposes the target's token at `position` (deterministic per sequence)."""
    digest = hashlib.blake2b(f"{seq_id}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < acceptance


class StandInVerifier:
    def __init__(self, step_time: StepTime, max_sequences: int, vocab: int, max_context: int, aux_width: int,
                 fp8: bool = False) -> None:
        self.time = step_time
        self.vocab = vocab
        self.table = SequenceTable(max_sequences, vocab, max_context)
        self.aux_width = aux_width
        self.hidden_for: set[str] = set()
        self.held: dict[str, int] = {}   # rows kept back (hold_hidden) per sequence, sent with its next verdict
        # the "hidden states" sent: bf16, or packed as --hidden-states-fp8 packs them (specdec/model/fp8_rows.py)
        self.rows = (torch.zeros(max_context, aux_width + 4, dtype=torch.uint8) if fp8 else
                     torch.zeros(max_context, aux_width, dtype=torch.bfloat16))

    def close(self, seq_ids: list[str]) -> None:
        for s in seq_ids:
            self.table.close(s)
            self.hidden_for.discard(s)
            self.held.pop(s, None)

    def step(self, req: VerifierStep) -> VerifierStepResult:
        self.close(req.close)
        self.hidden_for -= set(req.stop_hidden)
        for s in req.stop_hidden:
            self.held.pop(s, None)
        hold = set(req.hold_hidden)
        res, rows = VerifierStepResult(req.step), 0
        for o in req.open:
            state = self.table.open(o.seq_id, o.prompt_ids)
            if isinstance(state, SequenceError):
                res.errors.append(state)
                continue
            if o.want_hidden and self.aux_width:
                self.hidden_for.add(o.seq_id)
            rows += len(o.prompt_ids)
            res.verdicts.append(self._commit(state, [next_token(state.tokens, self.vocab)], 0, len(o.prompt_ids), hold))
        for item in req.verify:
            state = self.table.get(item.seq_id)
            accepted = self._walk(state.tokens, item.draft)
            rows += 1 + len(item.draft)
            res.verdicts.append(self._commit(state, accepted, len(accepted) - 1, len(accepted), hold))
        self.time.sleep(rows, bool(req.open))
        return res

    def _walk(self, tokens: list[int], draft: DraftTree) -> list[int]:
        """Accepted draft tokens along the tree, then the bonus token."""
        node, accepted = 0, []
        while True:
            want = next_token(tokens + accepted, self.vocab)
            child = next((i + 1 for i, p in enumerate(draft.parents) if p == node and draft.token_ids[i] == want), 0)
            accepted.append(want)
            if not child:
                return accepted
            node = child

    def _commit(self, state, accepted: list[int], accepted_drafts: int, hidden_rows: int,
                hold: set[str] = frozenset()) -> Verdict:
        state.tokens += accepted
        hidden = None
        if state.seq_id in self.hidden_for:
            if state.seq_id in hold:
                self.held[state.seq_id] = self.held.get(state.seq_id, 0) + hidden_rows
            else:
                hidden = self.rows[:self.held.pop(state.seq_id, 0) + hidden_rows]
        return Verdict(state.seq_id, len(state.tokens), accepted, accepted_drafts, hidden)


class StandInDrafter:
    def __init__(self, step_time: StepTime, max_sequences: int, vocab: int, max_context: int,
                 acceptance: float) -> None:
        self.time = step_time
        self.vocab = vocab
        self.table = SequenceTable(max_sequences, vocab, max_context)
        self.acceptance = acceptance

    def close(self, seq_ids: list[str]) -> None:
        for s in seq_ids:
            self.table.close(s)

    def step(self, req: DrafterStep) -> DrafterStepResult:
        self.close(req.close)
        res, rows, prompts = DrafterStepResult(req.step), 0, False
        for item in req.items:
            state = self.table.get(item.seq_id)
            if state is None:
                prompts = True
                state = self.table.open(item.seq_id, item.append_ids)
                if isinstance(state, SequenceError):
                    res.errors.append(state)
                    continue
            else:
                state.tokens += item.append_ids
            context = state.tokens + item.assumed_ids
            chain = []
            depth = item.shape.k if isinstance(item.shape, ChainShape) else min(item.shape.depth, item.shape.budget)
            for _ in range(depth):
                token = next_token(context + chain, self.vocab)
                chain.append(token if kept(item.seq_id, len(context) + len(chain), self.acceptance) else
                             self._wrong(token, 0))
            tree = (DraftTree.chain(chain) if isinstance(item.shape, ChainShape) else
                    self._tree(chain, item.shape.budget))
            rows += len(tree) + len(item.append_ids)
            res.drafts.append(Draft(item.seq_id, item.committed_len, len(item.assumed_ids), tree))
        self.time.sleep(rows, prompts)
        return res

    def _wrong(self, token: int, j: int) -> int:
        """A token other than `token` (the j-th such)."""
        return FIRST_ID + (token + 1 + j - FIRST_ID) % (self.vocab - FIRST_ID)

    def _tree(self, path: list[int], budget: int) -> DraftTree:
        """A tree of `budget` nodes: the path, then siblings of its nodes (depth first) that are
        never the target's token. So a tree costs what its shape costs and accepts what its path
        does: the stand-in models no gain from the alternatives."""
        tokens, parents = list(path), list(range(len(path)))
        j = 0
        while len(tokens) < budget:
            at = j % len(path)
            tokens.append(self._wrong(path[at], 1 + j // len(path)))
            parents.append(at)
            j += 1
        return DraftTree(tokens, parents)


def modelled_costs(role: str, step_time: StepTime, max_sequences: int) -> list[StepCost]:
    """The cost profile a real engine measures at start-up, from the model of its step time."""
    batches = [b for b in PROFILE_BATCHES if b <= max_sequences]
    if role == "verifier":
        shapes = {f"verify:{w}": w for w in VERIFY_WIDTHS}
    else:
        shapes = {**{chain_shape(k): k for k in AUTO_CHAIN_KS}, **{predraft_shape(k): 2 * k + 1 for k in AUTO_CHAIN_KS},
                  **{tree_shape(*t): t[2] for t in AUTO_TREES}}   # a tree's rows: its budget (StandInDrafter)
    return [StepCost(shape, b, step_time.base + step_time.per_row * rows * b)
            for shape, rows in shapes.items() for b in batches]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=("verifier", "drafter"), required=True)
    p.add_argument("--listen", required=True)
    p.add_argument("--base-ms", type=float, default=8.0, help="a step's fixed time")
    p.add_argument("--per-row-ms", type=float, default=0.01, help="time per token row computed")
    p.add_argument("--prompt-ms", type=float, default=0.0,
                   help="more time in a step that takes in a prompt (a forward of its own; H100, 8B: ~7.5)")
    p.add_argument("--max-sequences", type=int, default=64)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--max-draft-tokens", type=int, default=16)
    p.add_argument("--vocab", type=int, default=384, help="the gateway's tokenizer's vocabulary size")
    p.add_argument("--acceptance", type=float, default=0.8, help="drafter: chance that a drafted token is right")
    p.add_argument("--aux-width", type=int, default=0, help="bf16 values per hidden-state row (0: none)")
    p.add_argument("--hidden-states-fp8", action="store_true", help="verifier: rows packed to float8, as the real one")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    log = configure_logging(a.role)
    step_time = StepTime(a.base_ms / 1e3, a.per_row_ms / 1e3, a.prompt_ms / 1e3)
    info = common_pb2.ServiceInfo(
        role=a.role, model_name=f"stand-in-{a.role}", vocab_size=a.vocab, max_context=a.max_context,
        max_sequences=a.max_sequences, max_draft_tokens=a.max_draft_tokens, device="cpu", dtype="bfloat16",
        accelerators=[f"stand-in-{a.role}"], aux_hidden_layers=list(AUX_LAYERS) if a.aux_width else [],
        step_costs=[common_pb2.StepCost(shape=c.shape, batch=c.batch, seconds=c.seconds)
                    for c in modelled_costs(a.role, step_time, a.max_sequences)])
    executor = ThreadPoolExecutor(1, thread_name_prefix=f"{a.role}-engine")
    if a.role == "verifier":
        from verifier_svc.servicer import VerifierServicer

        engine = StandInVerifier(step_time, a.max_sequences, a.vocab, a.max_context, a.aux_width, a.hidden_states_fp8)
        servicer = VerifierServicer(engine, info, log, executor)
        register, pb2 = (lambda s: verifier_pb2_grpc.add_VerifierServicer_to_server(servicer, s)), verifier_pb2
    else:
        from drafter_svc.servicer import DrafterServicer

        engine = StandInDrafter(step_time, a.max_sequences, a.vocab, a.max_context, a.acceptance)
        servicer = DrafterServicer(engine, info, log, executor)
        register, pb2 = (lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s)), drafter_pb2
    log.info("stand-in engine", base_ms=a.base_ms, per_row_ms=a.per_row_ms, aux_width=a.aux_width)
    service = pb2.DESCRIPTOR.services_by_name[a.role.capitalize()].full_name
    if env_flag("MALLOC_TUNING") is not False:   # as the real services do once serving (--malloc-tuning)
        keep_freed_memory(log)
    run(serve(a.listen, register, service, log))


if __name__ == "__main__":
    main()
