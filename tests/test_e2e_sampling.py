"""Sampling through the real services: seeds make runs repeatable in every mode, n samples share
a prefill and differ, bad sampling settings are refused, and the CLI prints one JSON line per
sample. (That the distribution is exactly the target's is tests/test_sampling_distribution.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from cluster import request

from specdec.rpc import gateway_pb2

MODES = [("off", {}), ("chain", {"k": 3}), ("chain", {"k": 3, "overlap": False}), ("tree", {"topk": 2})]


@pytest.fixture(scope="module")
def cluster(checkpoints, start_cluster):
    return start_cluster(checkpoints["llama-gqa"], checkpoints["llama-gqa/draft"], extra=["--max-sequences", "80"])


@pytest.mark.parametrize("mode, spec", MODES)
def test_same_seed_same_output(cluster, mode, spec):
    sampling = {"temperature": 0.9, "top_p": 0.9, "top_k": 50, "seed": 1234}
    first, final = cluster.generate([3, 5, 7], 24, mode, sampling=sampling, **spec)
    again, _ = cluster.generate([3, 5, 7], 24, mode, sampling=sampling, **spec)
    other, _ = cluster.generate([3, 5, 7], 24, mode, sampling={**sampling, "seed": 99}, **spec)
    assert first == again and final.seed == 1234
    assert first != other


def test_n_samples_share_a_prefill_and_differ(cluster):
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 1, 9, 8]   # two prefill chunks (conftest: 6 tokens a step)
    before = cluster.info("verifier")
    req = request(prompt, 16, "chain")
    req.sampling.CopyFrom(gateway_pb2.Sampling(temperature=1.0, n=4, seed=7))
    outputs: dict[int, list[int]] = {}
    finals = {}
    for msg in cluster.gateway.Generate(req, timeout=60):
        outputs.setdefault(msg.sample_index, []).extend(msg.token_ids)
        if msg.HasField("final"):
            finals[msg.sample_index] = msg.final
    assert sorted(finals) == [0, 1, 2, 3] and all(len(o) == 16 for o in outputs.values())
    assert len({tuple(o) for o in outputs.values()}) > 1
    assert len({f.seed for f in finals.values()}) == 4
    after = cluster.info("verifier")
    assert after.sequences_opened - before.sequences_opened == 4
    # One prefill for the four samples: the prompt went through the model once.
    assert after.prefill_tokens_computed - before.prefill_tokens_computed == len(prompt)


@pytest.mark.parametrize("sampling, hint", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": 1.0, "top_p": 1.5}, "top_p"),
    ({"temperature": float("inf")}, "temperature=inf"), ({"temperature": float("nan")}, "temperature=nan"),
    ({"temperature": 1.0, "top_p": float("nan")}, "top_p=nan"),
    ({"temperature": 1.0, "n": 99}, "n=99"),
])
def test_bad_sampling_settings_are_invalid_argument(cluster, sampling, hint):
    req = request([1, 2, 3], 4)
    req.sampling.CopyFrom(gateway_pb2.Sampling(**sampling))
    with pytest.raises(grpc.RpcError) as err:
        list(cluster.gateway.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and hint in err.value.details()


def test_cli_prints_one_json_line_per_sample(cluster):
    out = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "generate", "--gateway", cluster.addr["gateway"], "--token-ids", "4,5,6",
         "--max-new-tokens", "8", "--ignore-eos", "--temperature", "0.8", "--top-k", "20", "--seed", "5", "--n", "3",
         "--json"], capture_output=True, text=True, timeout=120, check=True)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["sample_index"] for r in lines] == [0, 1, 2]
    assert all(len(r["output_token_ids"]) == 8 and r["prompt_token_ids"] == [4, 5, 6] for r in lines)


def test_sixty_four_samples_by_default_and_max_n_says_what_limits_more(cluster):
    wide = cluster
    req = request([4, 5, 6], 3)
    req.sampling.CopyFrom(gateway_pb2.Sampling(temperature=1.0, n=64, seed=3))
    finals = [m.final for m in wide.gateway.Generate(req, timeout=120) if m.HasField("final")]
    assert sorted(f.sample_index for f in finals) == list(range(64))
    req.sampling.n = 65
    with pytest.raises(grpc.RpcError) as err:
        list(wide.gateway.Generate(req, timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-n is 64" in err.value.details()
