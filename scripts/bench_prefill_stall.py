"""How long a long prompt arriving stalls the streams already running, with and without chunked
prefill: a verifier and a gateway (mode off, so every step is one token per stream) serve S
streams; once they are going, a request with a P-token prompt arrives. For each --prefill-chunk
value: the running streams' median gap between tokens before it, their longest gap while it is
prefilled, and its time to first token.

    python scripts/bench_prefill_stall.py --device cpu --prompt-tokens 2000 --chunks 0 512 256
    python scripts/bench_prefill_stall.py --device cuda --dtype bfloat16 --target /models/Llama-3.1-8B

Default target: the embedded SmolLM2-135M-Instruct (fetched once)."""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from cluster import Cluster, request  # noqa: E402


def stream(cluster: Cluster, prompt: list[int], n: int, stamps: list[float], done: threading.Event) -> None:
    for msg in cluster.gateway.Generate(request(prompt, n, "off"), timeout=600):
        if msg.token_ids:
            stamps.append(time.perf_counter())
    done.set()


def measure(target: Path, chunk: int, a) -> dict:
    cluster = Cluster(target, None, device=a.device, dtype=a.dtype,
                      verifier_extra=["--prefill-chunk", str(chunk), "--max-context", str(a.prompt_tokens + 64),
                                      "--max-sequences", str(a.streams + 2), "--no-cost-profile"]).start()
    try:
        vocab = cluster.info("verifier").vocab_size
        stamps = [[] for _ in range(a.streams)]
        dones = [threading.Event() for _ in range(a.streams)]
        threads = [threading.Thread(target=stream, args=(cluster, [100 + i, 200 + i, 300 + i], a.stream_tokens,
                                                          stamps[i], dones[i]), daemon=True)
                   for i in range(a.streams)]
        for t in threads:
            t.start()
        while min(len(s) for s in stamps) < 20:   # every stream is going
            time.sleep(0.01)
        long_prompt = [(37 * i + 11) % vocab for i in range(a.prompt_tokens)]
        sent = time.perf_counter()
        first = None
        for msg in cluster.gateway.Generate(request(long_prompt, 1, "off"), timeout=600):
            if msg.token_ids and first is None:
                first = time.perf_counter()
        for d in dones:
            d.wait(600)
        gaps_before = [b - a_ for s in stamps for a_, b in zip(s, s[1:]) if b < sent]
        gaps_during = [b - a_ for s in stamps for a_, b in zip(s, s[1:]) if b > sent and a_ < first]
        return {"chunk": chunk, "gap_p50_ms": 1e3 * statistics.median(gaps_before),
                "stall_max_ms": 1e3 * max(gaps_during, default=0.0), "long_ttft_ms": 1e3 * (first - sent)}
    finally:
        cluster.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="checkpoint dir (default: the embedded SmolLM2)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-tokens", type=int, default=2000)
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 512, 256])
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--stream-tokens", type=int, default=200, help="tokens each running stream generates")
    a = p.parse_args()
    if a.target:
        target = Path(a.target)
    else:
        from specdec.embedded_model import ensure_embedded_models

        target = ensure_embedded_models()[0]
    print(f"target {target}, {a.device}/{a.dtype}, {a.streams} running streams, a {a.prompt_tokens}-token prompt "
          "arrives", flush=True)
    print("| --prefill-chunk | running streams' gap p50 (ms) | their longest gap while it prefills (ms) | "
          "its TTFT (ms) |\n|---:|---:|---:|---:|", flush=True)
    for chunk in a.chunks:
        r = measure(target, chunk, a)
        print(f"| {chunk or 'off (whole prompt)'} | {r['gap_p50_ms']:.1f} | {r['stall_max_ms']:.1f} | "
              f"{r['long_ttft_ms']:.1f} |", flush=True)


if __name__ == "__main__":
    main()
