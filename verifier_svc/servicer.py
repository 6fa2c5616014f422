"""gRPC servicer of the verifier: protobuf <-> engine dataclasses (stream handling is shared)."""

from __future__ import annotations

from specdec.rpc import verifier_pb2, verifier_pb2_grpc
from specdec.rpc.convert import error_to_proto, sampling_from_proto, tree_from_proto
from specdec.rpc.tensor_payload import fill_payload
from specdec.step_servicer import StepStreamServicer
from verifier_svc.types import OpenSequence, VerifierStep, VerifierStepResult, VerifyItem


class VerifierServicer(StepStreamServicer, verifier_pb2_grpc.VerifierServicer):
    def step_from_proto(self, msg: verifier_pb2.VerifyStepRequest) -> VerifierStep:
        return VerifierStep(
            step=msg.step,
            open=[OpenSequence(o.seq_id, list(o.prompt_ids), sampling_from_proto(o.sampling), o.share_prefill_with,
                               o.want_hidden_states) for o in msg.open],
            verify=[VerifyItem(v.seq_id, v.committed_len, tree_from_proto(v.draft)) for v in msg.verify],
            close=list(msg.close),
            stop_hidden=list(msg.stop_hidden_states),
            hold_hidden=list(msg.hold_hidden_states),
        )

    def result_to_proto(self, res: VerifierStepResult) -> verifier_pb2.VerifyStepResponse:
        msg = verifier_pb2.VerifyStepResponse(step=res.step, errors=[error_to_proto(e) for e in res.errors])
        for v in res.verdicts:   # filled in place: hidden states are copied once, not once per level
            out = msg.verdicts.add(seq_id=v.seq_id, committed_len=v.committed_len, accepted_ids=v.accepted_ids,
                                   accepted_drafts=v.accepted_drafts)
            if v.hidden is not None:
                fill_payload(out.hidden_states, v.hidden)
        return msg

    def held_after(self, req: VerifierStep, res: VerifierStepResult) -> set[str]:
        failed = {e.seq_id for e in res.errors}
        return {o.seq_id for o in req.open if o.seq_id not in failed}
