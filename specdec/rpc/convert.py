"""Conversions between protobuf messages and the plain dataclasses both engines share."""

from __future__ import annotations

from specdec.errors import ErrorCode, SequenceError
from specdec.rpc import common_pb2
from specdec.tree import DraftTree


def tree_from_proto(msg: common_pb2.DraftTree) -> DraftTree:
    return DraftTree(list(msg.token_ids), list(msg.parents), list(msg.logprobs))


def tree_to_proto(tree: DraftTree) -> common_pb2.DraftTree:
    return common_pb2.DraftTree(token_ids=tree.token_ids, parents=tree.parents, logprobs=tree.logprobs)


def error_to_proto(err: SequenceError) -> common_pb2.SequenceError:
    return common_pb2.SequenceError(seq_id=err.seq_id, code=int(err.code), message=err.message)


def error_from_proto(msg: common_pb2.SequenceError) -> SequenceError:
    return SequenceError(msg.seq_id, ErrorCode(msg.code), msg.message)
