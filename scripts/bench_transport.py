"""Where a step's time goes between the gateway and the verifier, apart from the model: the bare
gRPC (grpc.aio + uvloop) round trip on the Verifier.Step stream, the same with the hop to the
engine's worker thread, and a real verifier process (a tiny random model): its round trip, the
engine time it reports for each step, and so "transport" = round trip - that engine time, at
several batch sizes (the same engine called in this process is shown beside it: a second process
on the same cores runs its engine slower, so that difference overstates transport). Then the EAGLE-3 hidden-state
payload a verdict carries per step (committed tokens x the head's layers x hidden size, bf16):
its bytes and the time of each of its hops -- device-to-host copy of the captured rows, encoding
into the Verdict and DraftItem messages, decoding on the other side.

    python scripts/bench_transport.py --batch 1 16 64 --device cpu
    python scripts/bench_transport.py --batch 1 16 --payload-only --aux-width 1728 12288 --tokens 4
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster import free_port, wait_serving  # noqa: E402
from model_factory import make_checkpoint  # noqa: E402

from gateway.backends import StepStream  # noqa: E402
from specdec.model.loader import load_model  # noqa: E402
from specdec.model.runner import ModelRunner  # noqa: E402
from specdec.rpc import verifier_pb2, verifier_pb2_grpc  # noqa: E402
from specdec.rpc.convert import tree_to_proto  # noqa: E402
from specdec.tree import DraftTree  # noqa: E402
from verifier_svc.engine import VerifierEngine  # noqa: E402
from verifier_svc.types import OpenSequence, VerifierStep, VerifyItem  # noqa: E402

STEPS = 300


class EchoVerifier(verifier_pb2_grpc.VerifierServicer):
    """Answers each step at once, optionally after a round trip through a one-thread executor."""

    def __init__(self, hop: bool) -> None:
        self.hop = hop
        self.executor = ThreadPoolExecutor(1)

    async def Step(self, request_iterator, context):
        loop = asyncio.get_running_loop()
        async for msg in request_iterator:
            if self.hop:
                await loop.run_in_executor(self.executor, lambda: None)
            yield verifier_pb2.VerifyStepResponse(step=msg.step)


def _echo_server(port: int, hop: bool, ready) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        verifier_pb2_grpc.add_VerifierServicer_to_server(EchoVerifier(hop), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        ready.set()
        await server.wait_for_termination()
    uvloop.run(main())


def echo_round_trip(hop: bool) -> float:
    port, ready = free_port(), mp.Event()
    proc = mp.Process(target=_echo_server, args=(port, hop, ready), daemon=True)
    proc.start()
    ready.wait()

    async def client() -> float:
        stream = StepStream("verifier", f"127.0.0.1:{port}")
        times = []
        for i in range(STEPS):
            t0 = time.perf_counter()
            await stream.step(verifier_pb2.VerifyStepRequest(step=i))
            times.append(time.perf_counter() - t0)
        await stream.close()
        return statistics.median(times[STEPS // 10:])
    try:
        return uvloop.run(client())
    finally:
        proc.terminate()


def engine_step(checkpoint: Path, batch: int, device: str) -> float:
    """p50 of the verifier engine's mode-off step, called in this process."""
    engine = VerifierEngine(ModelRunner(load_model(checkpoint, torch.float32, torch.device(device))), batch, 512, 16)
    ids = [f"s{i}" for i in range(batch)]
    lengths = {v.seq_id: v.committed_len for v in engine.step(VerifierStep(0, open=[
        OpenSequence(s, [1, 2, 3]) for s in ids])).verdicts}
    times = []
    for i in range(STEPS):
        t0 = time.perf_counter()
        res = engine.step(VerifierStep(i + 1, verify=[VerifyItem(s, lengths[s], DraftTree()) for s in ids]))
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        lengths.update({v.seq_id: v.committed_len for v in res.verdicts})
    return statistics.median(times[STEPS // 10:])


def verifier_round_trip(checkpoint: Path, batch: int, device: str) -> tuple[float, float]:
    """The same step sent to a verifier process over its Step stream -> p50 of the round trip and
    of the round trip less the engine time the verifier reported for it."""
    addr = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "verifier", "--model", str(checkpoint),
                             "--listen", addr, "--device", device, "--dtype", "float32", "--max-context", "512",
                             "--max-sequences", str(max(batch, 1))], stderr=subprocess.DEVNULL)
    try:
        wait_serving(addr, proc=proc)

        async def client() -> tuple[float, float]:
            stream = StepStream("verifier", addr)
            ids = [f"s{i}" for i in range(batch)]
            resp = await stream.step(verifier_pb2.VerifyStepRequest(step=1, open=[
                verifier_pb2.OpenSequence(seq_id=s, prompt_ids=[1, 2, 3]) for s in ids]))
            lengths = {v.seq_id: v.committed_len for v in resp.verdicts}
            times, transport = [], []
            for i in range(STEPS):
                msg = verifier_pb2.VerifyStepRequest(step=i + 2, verify=[verifier_pb2.VerifyItem(
                    seq_id=s, committed_len=lengths[s], draft=tree_to_proto(DraftTree())) for s in ids])
                t0 = time.perf_counter()
                resp = await stream.step(msg)
                times.append(time.perf_counter() - t0)
                transport.append(times[-1] - resp.engine_seconds)
                lengths.update({v.seq_id: v.committed_len for v in resp.verdicts})
            await stream.close()
            return statistics.median(times[STEPS // 10:]), statistics.median(transport[STEPS // 10:])
        return uvloop.run(client())
    finally:
        proc.terminate()
        proc.wait()


def payload_cost(batch: int, tokens: int, width: int, device: str, reps: int = 50) -> dict:
    """One step's hidden-state payload: [batch, tokens, width] bf16 rows gathered on the device,
    copied to the host, encoded per sequence into a Verdict, decoded by the gateway and encoded
    again into a DraftItem, decoded by the drafter -> bytes and ms of each hop."""
    from specdec.rpc import common_pb2
    from specdec.rpc.tensor_payload import payloads_to_tensors, tensor_to_payload

    aux = torch.randn(batch, tokens + 4, width, dtype=torch.bfloat16, device=device)
    path = torch.arange(tokens, device=device).expand(batch, tokens)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def timed(fn):
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn()
        sync()
        return (time.perf_counter() - t0) / reps * 1e3, out

    copy_ms, host = timed(lambda: torch.gather(aux, 1, path[:, :, None].expand(-1, -1, width)).cpu())
    encode_ms, wire = timed(lambda: [common_pb2.TensorPayload.SerializeToString(tensor_to_payload(h)) for h in host])
    decode_ms, _ = timed(lambda: payloads_to_tensors([common_pb2.TensorPayload.FromString(w) for w in wire]))
    return {"bytes": sum(len(w) for w in wire), "copy_ms": copy_ms, "encode_ms": encode_ms, "decode_ms": decode_ms}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--aux-width", type=int, nargs="+", default=[3 * 576, 3 * 4096],
                   help="hidden-state row widths: 3 x hidden of SmolLM2-135M and of an 8B target")
    p.add_argument("--tokens", type=int, default=4, help="committed tokens per sequence and step")
    p.add_argument("--payload-only", action="store_true")
    a = p.parse_args()
    print("| batch | row width | bytes per step | device->host ms | encode ms | decode ms | payload ms per step |")
    print("|---|---|---|---|---|---|---|")
    for b in a.batch:
        for w in a.aux_width:
            c = payload_cost(b, a.tokens, w, a.device)
            # the verifier encodes and the gateway decodes; the gateway encodes again and the drafter decodes
            total = c["copy_ms"] + 2 * (c["encode_ms"] + c["decode_ms"])
            print(f"| {b} | {w} | {c['bytes']} | {c['copy_ms']:.3f} | {c['encode_ms']:.3f} | {c['decode_ms']:.3f} "
                  f"| {total:.3f} |", flush=True)
    if a.payload_only:
        return
    print(f"bare gRPC round trip: {1e3 * echo_round_trip(False):.3f} ms; "
          f"with the worker-thread hop: {1e3 * echo_round_trip(True):.3f} ms", flush=True)
    checkpoint = make_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "llama-gqa", seed=0, num_layers=1)
    print("| batch | engine step ms (this process) | through the verifier process ms | transport ms |")
    print("|---|---|---|---|")
    for b in a.batch:
        engine, (remote, transport) = engine_step(checkpoint, b, a.device), verifier_round_trip(checkpoint, b, a.device)
        print(f"| {b} | {1e3 * engine:.3f} | {1e3 * remote:.3f} | {1e3 * transport:.3f} |", flush=True)


if __name__ == "__main__":
    main()
