"""Conversions between protobuf messages and the plain dataclasses both engines share."""

from __future__ import annotations

from specdec.cost_profile import StepCost
from specdec.draft_tree import DraftTree, Proposal
from specdec.errors import ErrorCode, SequenceError
from specdec.rpc import common_pb2
from specdec.sampling_params import GREEDY, SamplingParams


def tree_from_proto(msg: common_pb2.DraftTree) -> DraftTree:
    return DraftTree(list(msg.token_ids), list(msg.parents), list(msg.logprobs),
                     [Proposal(list(p.token_ids), list(p.probs)) for p in msg.proposals])


def tree_to_proto(tree: DraftTree) -> common_pb2.DraftTree:
    return common_pb2.DraftTree(
        token_ids=tree.token_ids, parents=tree.parents, logprobs=tree.logprobs,
        proposals=[common_pb2.SparseDistribution(token_ids=p.token_ids, probs=p.probs) for p in tree.proposals],
    )


def sampling_from_proto(msg: common_pb2.SamplingParams) -> SamplingParams:
    if msg.temperature <= 0:
        return GREEDY
    return SamplingParams(msg.temperature, msg.top_p or 1.0, msg.top_k, msg.seed)


def sampling_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, seed=p.seed)


def error_to_proto(err: SequenceError) -> common_pb2.SequenceError:
    return common_pb2.SequenceError(seq_id=err.seq_id, code=int(err.code), message=err.message)


def error_from_proto(msg: common_pb2.SequenceError) -> SequenceError:
    return SequenceError(msg.seq_id, ErrorCode(msg.code), msg.message)


def costs_from_info(info: common_pb2.ServiceInfo) -> list[StepCost]:
    return [StepCost(c.shape, c.batch, c.seconds) for c in info.step_costs]
