"""Where a step's time goes between the gateway and the verifier, apart from the model: the bare
gRPC (grpc.aio + uvloop) round trip on the Verifier.Step stream, the same with the hop to the
engine's worker thread, and a real verifier process (a tiny random model) against its own engine
called in-process -- so "transport" = round trip - engine step, at several batch sizes.

    python scripts/bench_transport.py --batch 1 16 64 --device cpu
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


def verifier_round_trip(checkpoint: Path, batch: int, device: str) -> float:
    """p50 of the same step sent to a verifier process over its Step stream."""
    addr = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "specdec.cli", "verifier", "--model", str(checkpoint),
                             "--listen", addr, "--device", device, "--dtype", "float32", "--max-context", "512",
                             "--max-sequences", str(max(batch, 1))], stderr=subprocess.DEVNULL)
    try:
        wait_serving(addr, proc=proc)

        async def client() -> float:
            stream = StepStream("verifier", addr)
            ids = [f"s{i}" for i in range(batch)]
            resp = await stream.step(verifier_pb2.VerifyStepRequest(step=1, open=[
                verifier_pb2.OpenSequence(seq_id=s, prompt_ids=[1, 2, 3]) for s in ids]))
            lengths = {v.seq_id: v.committed_len for v in resp.verdicts}
            times = []
            for i in range(STEPS):
                msg = verifier_pb2.VerifyStepRequest(step=i + 2, verify=[verifier_pb2.VerifyItem(
                    seq_id=s, committed_len=lengths[s], draft=tree_to_proto(DraftTree())) for s in ids])
                t0 = time.perf_counter()
                resp = await stream.step(msg)
                times.append(time.perf_counter() - t0)
                lengths.update({v.seq_id: v.committed_len for v in resp.verdicts})
            await stream.close()
            return statistics.median(times[STEPS // 10:])
        return uvloop.run(client())
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    print(f"bare gRPC round trip: {1e3 * echo_round_trip(False):.3f} ms; "
          f"with the worker-thread hop: {1e3 * echo_round_trip(True):.3f} ms", flush=True)
    checkpoint = make_checkpoint(Path(tempfile.mkdtemp()) / "tiny", "llama-gqa", seed=0, num_layers=1)
    print("| batch | engine step ms | through the verifier process ms | transport ms |")
    print("|---|---|---|---|")
    for b in a.batch:
        engine, remote = engine_step(checkpoint, b, a.device), verifier_round_trip(checkpoint, b, a.device)
        print(f"| {b} | {1e3 * engine:.3f} | {1e3 * remote:.3f} | {1e3 * (remote - engine):.3f} |", flush=True)


if __name__ == "__main__":
    main()
