"""The CPU time a speculative step's messages cost, hop by hop, with glibc's default malloc and with
the services' tuning (specdec/malloc_tuning.py, `--malloc-tuning`): the gateway builds the verify
request, the verifier decodes it and encodes its verdicts (each request's accepted rows as fp8
hidden states, as the GPU verifier sends an 8B target's), the gateway parses them and builds the
draft request around the same rows, the drafter decodes it and encodes its drafts. The real
servicers' conversions and protobuf; no engine, no gRPC (whose own copies come on top).

    python scripts/bench_step_messages.py --batch 16 32 64
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # allow running without installing


def measure(batch: int, rows: int, row_bytes: int, repeats: int) -> dict[str, float]:
    """ms per call of each hop's work for one step at `batch`."""
    import torch

    from drafter_svc import types as drafter
    from drafter_svc.servicer import DrafterServicer
    from specdec.draft_tree import DraftTree
    from specdec.rpc import drafter_pb2, verifier_pb2
    from specdec.rpc.convert import sampling_to_proto, tree_to_proto
    from specdec.sampling_params import GREEDY
    from verifier_svc.servicer import VerifierServicer
    from verifier_svc.types import Verdict, VerifierStepResult

    def ms(f) -> float:
        f()
        t0 = time.perf_counter()
        for _ in range(repeats):
            f()
        return (time.perf_counter() - t0) / repeats * 1e3

    ids = [f"{i:032x}" for i in range(batch)]
    chain = DraftTree(list(range(1, rows + 1)), list(range(rows)), [0.0] * rows)
    verifier, drafter_servicer = VerifierServicer.__new__(VerifierServicer), DrafterServicer.__new__(DrafterServicer)

    def verify_request():
        return verifier_pb2.VerifyStepRequest(step=1, verify=[
            verifier_pb2.VerifyItem(seq_id=s, committed_len=100, draft=tree_to_proto(chain)) for s in ids])

    request = verify_request()
    result = VerifierStepResult(1, [Verdict(s, 100 + rows, chain.token_ids, rows - 1,
                                            torch.zeros(rows, row_bytes, dtype=torch.uint8)) for s in ids], [])
    verdicts = verifier.result_to_proto(result)
    verdict_bytes = verdicts.SerializeToString()

    def draft_request():
        msg = drafter_pb2.DraftStepRequest(step=2)
        for v in verdicts.verdicts:
            item = msg.items.add(seq_id=v.seq_id, committed_len=100 + rows, append_ids=chain.token_ids,
                                 sampling=sampling_to_proto(GREEDY))
            item.chain.k = rows
            item.hidden_states.CopyFrom(v.hidden_states)
        return msg

    draft = draft_request()
    draft_bytes = draft.SerializeToString()
    drafts = drafter.DrafterStepResult(2, [drafter.Draft(s, 100 + rows, 0, chain) for s in ids])
    return {
        "gateway: verify request": ms(verify_request),
        "verifier: decode": ms(lambda: verifier.step_from_proto(request)),
        "verifier: encode verdicts": ms(lambda: verifier.result_to_proto(result)),
        "verifier: serialize": ms(verdicts.SerializeToString),
        "gateway: parse verdicts": ms(lambda: verifier_pb2.VerifyStepResponse.FromString(verdict_bytes)),
        "gateway: draft request": ms(draft_request),
        "gateway: serialize": ms(draft.SerializeToString),
        "drafter: parse + decode": ms(lambda: drafter_servicer.step_from_proto(
            drafter_pb2.DraftStepRequest.FromString(draft_bytes))),
        "drafter: encode drafts": ms(lambda: drafter_servicer.result_to_proto(drafts)),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--rows", type=int, default=4, help="rows a verdict carries (accepted drafts + 1)")
    p.add_argument("--row-bytes", type=int, default=4100, help="bytes a row (fp8 8B target: 4,096 + a scale)")
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--one", choices=["default", "tuned"], help=argparse.SUPPRESS)   # a child's single run
    a = p.parse_args(argv)
    if a.one:   # mallopt cannot be undone: each setting runs in a process of its own
        if a.one == "tuned":
            from specdec.malloc_tuning import keep_freed_memory

            assert keep_freed_memory(type("Log", (), {"info": lambda *args, **kw: None})()), "glibc only"
        print(json.dumps({b: measure(b, a.rows, a.row_bytes, a.repeats) for b in a.batch}))
        return
    runs = {}
    for setting in ("default", "tuned"):
        out = subprocess.run([sys.executable, __file__, "--one", setting, "--batch", *map(str, a.batch),
                              "--rows", str(a.rows), "--row-bytes", str(a.row_bytes), "--repeats", str(a.repeats)],
                             check=True, capture_output=True, text=True).stdout
        runs[setting] = json.loads(out)
    print("| batch | hop | default malloc ms | tuned ms |")
    print("|---|---|---|---|")
    for b in map(str, a.batch):
        for hop, default in runs["default"][b].items():
            print(f"| {b} | {hop} | {default:.3f} | {runs['tuned'][b][hop]:.3f} |")
        print(f"| {b} | **all** | **{sum(runs['default'][b].values()):.2f}** | "
              f"**{sum(runs['tuned'][b].values()):.2f}** |")


if __name__ == "__main__":
    main()
