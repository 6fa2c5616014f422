"""`specdec serve` supervises its children: kill -9 of the drafter mid-request loses no token (the
request finishes in mode off with the target's tokens), the drafter is restarted and drafts again;
kill -9 of the verifier: a request waits for it (a bounded time) and completes with the same
tokens, or ends UNAVAILABLE; once it is back, new requests succeed; SIGTERM stops everything (exit 0, saying so); a child that keeps dying is a crash loop
that stops serve with exit 1, naming it."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from cluster import free_port, request
from model_factory import hf_greedy

from specdec.rpc import gateway_pb2_grpc


class Serve:
    def __init__(self, target, draft, *extra: str) -> None:
        self.listen = f"127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specdec.cli", "serve", "--target", str(target), "--draft", str(draft),
             "--device", "cpu", "--dtype", "float64", "--listen", self.listen, *extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "SPECDEC_DRAIN_SECONDS": "5"})
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(x) for x in self.proc.stderr], daemon=True).start()

    def wait_line(self, pattern: str, timeout: float = 120) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.seen:
                if (m := re.search(pattern, line)):
                    self.seen.remove(line)
                    return m
            try:
                self.seen.append(self.lines.get(timeout=0.2))
            except queue.Empty:
                pass
        raise AssertionError(f"no line matching {pattern!r}; saw {self.seen[-10:]}")

    def pid(self, name: str) -> int:
        return int(self.wait_line(rf"{name} started \(pid (\d+)\)").group(1))

    def generate(self, prompt, n, mode="chain", timeout=60, **spec):
        with grpc.insecure_channel(self.listen) as ch:
            stub = gateway_pb2_grpc.GatewayStub(ch)
            ids, final = [], None
            for msg in stub.Generate(request(prompt, n, mode, **spec), timeout=timeout):
                ids += msg.token_ids
                final = msg.final if msg.HasField("final") else final
            return ids, final


def test_serve_restarts_a_lost_drafter_and_verifier(checkpoints):
    target = checkpoints["llama-tied"]
    serve = Serve(target, target)   # self-drafted: every draft accepted while the drafter is up
    try:
        pids = {name: serve.pid(name) for name in ("verifier", "drafter", "gateway")}
        assert serve.proc.stdout.readline().startswith("gateway listening")
        want = hf_greedy(target, [4, 8, 15], 40)
        assert serve.generate([4, 8, 15], 40, k=4)[0] == want

        os.kill(pids["drafter"], signal.SIGKILL)
        ids, final = serve.generate([4, 8, 15], 40, k=4)         # during the outage: mode off, same tokens
        assert ids == want
        serve.wait_line(r"drafter exited with code -9; restarting it")
        serve.pid("drafter")
        deadline = time.monotonic() + 90
        while (final := serve.generate([4, 8, 15], 40, k=4)[1]).stats.mode != "chain":   # drafts again
            assert time.monotonic() < deadline, "the restarted drafter was never used"
            time.sleep(1)

        os.kill(pids["verifier"], signal.SIGKILL)
        try:   # it waits for the verifier (--backend-wait-seconds): exact tokens if it is back in time
            assert serve.generate([4, 8, 15], 40, k=4, timeout=60)[0] == want
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        serve.wait_line(r"verifier exited with code -9; restarting it")
        serve.pid("verifier")
        deadline = time.monotonic() + 90
        while True:
            try:
                assert serve.generate([4, 8, 15], 40, k=4)[0] == want
                break
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAVAILABLE and time.monotonic() < deadline, exc
                time.sleep(1)
    finally:
        serve.proc.send_signal(signal.SIGTERM)
        code = serve.proc.wait(timeout=60)
    assert code == 0
    serve.wait_line(r"stopping on SIGTERM")


def test_a_crash_loop_stops_serve_and_names_the_child(checkpoints, tmp_path):
    serve = Serve(checkpoints["llama-tied"], tmp_path / "no-such-draft", "--max-restarts", "1")
    assert serve.proc.wait(timeout=120) == 1
    serve.wait_line(r"stopping: drafter exited 2 times within 60 s .*a crash loop")
