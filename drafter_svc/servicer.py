"""gRPC servicer of the drafter: protobuf <-> engine dataclasses (stream handling is shared)."""

from __future__ import annotations

import torch

from drafter_svc.types import ChainShape, DrafterStep, DrafterStepResult, DraftItem, TreeShape
from specdec.rpc import drafter_pb2, drafter_pb2_grpc
from specdec.rpc.convert import error_to_proto, sampling_from_proto, tree_to_proto
from specdec.rpc.tensor_payload import payloads_to_tensors
from specdec.step_servicer import StepStreamServicer


def item_from_proto(m: drafter_pb2.DraftItem, hidden: torch.Tensor | None) -> DraftItem:
    """hidden: m's hidden_states, decoded (all of a step's at once, see step_from_proto)."""
    if m.WhichOneof("shape") == "tree":
        shape: ChainShape | TreeShape = TreeShape(m.tree.topk, m.tree.depth, m.tree.budget)
    else:
        shape = ChainShape(m.chain.k)
    return DraftItem(m.seq_id, m.committed_len, list(m.append_ids), list(m.assumed_ids), shape,
                     sampling_from_proto(m.sampling), hidden)


class DrafterServicer(StepStreamServicer, drafter_pb2_grpc.DrafterServicer):
    def step_from_proto(self, msg: drafter_pb2.DraftStepRequest) -> DrafterStep:
        carrying = [i for i, m in enumerate(msg.items) if m.HasField("hidden_states")]
        decoded = dict(zip(carrying, payloads_to_tensors([msg.items[i].hidden_states for i in carrying])))
        return DrafterStep(msg.step, [item_from_proto(m, decoded.get(i)) for i, m in enumerate(msg.items)],
                           list(msg.close))

    def result_to_proto(self, res: DrafterStepResult) -> drafter_pb2.DraftStepResponse:
        return drafter_pb2.DraftStepResponse(
            step=res.step,
            drafts=[
                drafter_pb2.Draft(seq_id=d.seq_id, committed_len=d.committed_len, assumed_len=d.assumed_len,
                                  tree=tree_to_proto(d.tree),
                                  hedges=[drafter_pb2.Hedge(accepted=j, chain=tree_to_proto(c))
                                          for j, c in sorted(d.hedges.items())])
                for d in res.drafts
            ],
            errors=[error_to_proto(e) for e in res.errors],
        )

    def held_after(self, req: DrafterStep, res: DrafterStepResult) -> set[str]:
        return {d.seq_id for d in res.drafts}
