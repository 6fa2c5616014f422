"""The engines driven in-process: VerifierEngine and the controlled-acceptance DrafterEngine called
directly in a step loop (as scripts/profile_step.py does for the verifier), so the same run
through the gateway shows what gRPC, protobuf and the gateway's loop add per step.

The loop is the gateway scheduler's (gateway/scheduler.py) without the transport: prefill all
sequences of the wave in one step, draft for every sequence without a draft, one batched verify
step; in chain mode with overlap the drafter pre-drafts step t+1 on a second thread while step t
is verified, and the pre-draft is used only if the draft was fully accepted and the bonus token
equals its first token. Engines load and warm up exactly as specdec/engine_service.py does.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from benchmarks.grid import SpecConfig
from benchmarks.metrics import SeqTrace
from benchmarks.models import EngineSettings, ModelPair
from drafter_svc.controlled import ControlledAcceptanceDrafter
from drafter_svc.types import ChainShape, DraftItem, DrafterStep, TreeShape
from drafter_svc.warmup import warm_up as warm_up_drafter
from specdec.model.cuda_graphs import verify_query_lens
from specdec.model.loader import DTYPES, load_model
from specdec.model.runner import ModelRunner
from specdec.tree import DraftTree
from verifier_svc.engine import VerifierEngine
from verifier_svc.types import OpenSequence, VerifierStep, VerifyItem
from verifier_svc.warmup import warm_up as warm_up_verifier


@dataclass
class Engines:
    verifier: VerifierEngine
    drafter: ControlledAcceptanceDrafter
    pool: ThreadPoolExecutor          # the drafter's thread for overlap pre-drafts
    runs: int = 0

    def close(self) -> None:
        self.pool.shutdown()


def load_engines(pair: ModelPair, device: str, dtype: str, s: EngineSettings) -> Engines:
    dev, dt = torch.device(device), DTYPES[dtype]
    verifier = VerifierEngine(ModelRunner(load_model(pair.target, dt, dev)), s.max_sequences, s.max_context,
                              s.max_draft_tokens)
    drafter = ControlledAcceptanceDrafter(ModelRunner(load_model(pair.draft, dt, dev)), s.max_sequences,
                                          s.max_context)
    if s.cuda_graphs and dev.type == "cuda":
        verifier.runner.capture_cuda_graphs(s.max_sequences, verify_query_lens(s.max_draft_tokens))
        drafter.capture_cuda_graphs()  # catch-up feeds and whole greedy chains
    warm_up_verifier(verifier)
    warm_up_drafter(drafter)
    return Engines(verifier, drafter, ThreadPoolExecutor(1, thread_name_prefix="bench-drafter"))


@dataclass
class _Seq:
    sid: str
    trace: SeqTrace
    tokens: list[int]
    prompt_len: int
    drafter_len: int = 0              # committed tokens the drafter has been sent
    draft: DraftTree | None = None
    predraft: DraftTree | None = None
    done: bool = False


@dataclass
class Timing:
    """Synchronous drafter calls (drafts needed before a verify step) and verifier calls."""

    draft_s: float = 0.0
    draft_calls: int = 0
    verify_s: float = 0.0
    verify_calls: int = 0

    def means_ms(self) -> tuple[float | None, float | None]:
        return (1e3 * self.draft_s / self.draft_calls if self.draft_calls else None,
                1e3 * self.verify_s / self.verify_calls if self.verify_calls else None)


def _item(s: _Seq, cfg: SpecConfig, predraft: bool) -> DraftItem:
    if predraft:  # draft after the chain in flight; one extra token guesses its bonus token
        shape: ChainShape | TreeShape = ChainShape(cfg.k + 1)
    else:
        shape = TreeShape(cfg.topk, cfg.depth, cfg.budget) if cfg.mode == "tree" else ChainShape(cfg.k)
    item = DraftItem(s.sid, len(s.tokens), s.tokens[s.drafter_len:], list(s.draft.token_ids) if predraft else [],
                     shape)
    s.drafter_len = len(s.tokens)
    return item


def _checked(result, what: str):
    if result.errors:
        raise RuntimeError(f"{what} refused a benchmark sequence: {result.errors[0]}")
    return result


def run_inprocess(eng: Engines, prompts: list[list[int]], max_new: int,
                  cfg: SpecConfig) -> tuple[list[SeqTrace], Timing]:
    """One wave: every prompt generates max_new tokens, all sequences batched together."""
    eng.runs += 1
    ver, dr, timing = eng.verifier, eng.drafter, Timing()
    t0 = time.perf_counter()
    seqs = [_Seq(f"bench{eng.runs}-{i}", SeqTrace(t0), list(p), len(p)) for i, p in enumerate(prompts)]
    by_id = {s.sid: s for s in seqs}
    res = _checked(ver.step(VerifierStep(0, open=[OpenSequence(s.sid, s.tokens) for s in seqs])), "verifier")
    _commit(by_id, res.verdicts, max_new, ver, dr, prefill=True)
    active, step = [s for s in seqs if not s.done], 0
    while active:
        step += 1
        need = [s for s in active if cfg.speculative and s.draft is None]
        if need:
            t = time.perf_counter()
            drafts = _checked(dr.step(DrafterStep(2 * step, [_item(s, cfg, False) for s in need])), "drafter").drafts
            timing.draft_s += time.perf_counter() - t
            timing.draft_calls += 1
            for d in drafts:
                by_id[d.seq_id].draft = d.tree
        overlap = [s for s in active if cfg.mode == "chain" and cfg.overlap and s.draft is not None]
        pre = (eng.pool.submit(dr.step, DrafterStep(2 * step + 1, [_item(s, cfg, True) for s in overlap]))
               if overlap else None)
        t = time.perf_counter()
        verdicts = _checked(ver.step(VerifierStep(step, verify=[
            VerifyItem(s.sid, len(s.tokens), s.draft or DraftTree()) for s in active])), "verifier").verdicts
        timing.verify_s += time.perf_counter() - t
        timing.verify_calls += 1
        if pre is not None:
            for d in _checked(pre.result(), "drafter").drafts:
                by_id[d.seq_id].predraft = d.tree
        _commit(by_id, verdicts, max_new, ver, dr, prefill=False)
        active = [s for s in active if not s.done]
    return [s.trace for s in seqs], timing


def _commit(by_id: dict[str, _Seq], verdicts, max_new: int, ver, dr, prefill: bool) -> None:
    """Apply a verify step's verdicts: counters, the overlap hit rule, emitted tokens, retirement."""
    now = time.perf_counter()
    finished = []
    for v in verdicts:
        s = by_id[v.seq_id]
        tr = s.trace
        if not prefill:
            drafted = len(s.draft) if s.draft else 0
            tr.steps += 1
            tr.drafted += drafted
            tr.accepted += v.accepted_drafts
            tr.committed += len(v.accepted_ids)
            if drafted:
                tr.depth_sum += s.draft.shape()[0]
                tr.drafted_steps += 1
                low = tr.min_step_accepted
                tr.min_step_accepted = v.accepted_drafts if low is None else min(low, v.accepted_drafts)
            full = s.draft is not None and v.accepted_drafts == drafted
            s.draft = None
            if s.predraft is not None:
                if full and len(s.predraft) > 1 and s.predraft.token_ids[0] == v.accepted_ids[-1]:
                    s.draft = s.predraft.suffix(1)
                    tr.overlap_hits += 1
                else:
                    tr.overlap_misses += 1
                s.predraft = None
        new = v.accepted_ids[: max_new - (len(s.tokens) - s.prompt_len)]
        s.tokens += new
        tr.arrived(now, new)
        if len(s.tokens) - s.prompt_len >= max_new:
            s.done = True
            finished.append(s.sid)
    if finished:
        ver.close(finished)
        dr.close(finished)
