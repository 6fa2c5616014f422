"""Shared fixtures: random checkpoints (built once per session) and running clusters."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run through its CPU interpreter in tests; this must be set before
# any kernel is defined. (Services never run Triton on CPU tensors, so they are unaffected.)
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Services the tests start: no start-up cost profile (tests that exercise --mode auto's policy ask
# for it with --cost-profile), a short drain on SIGTERM (tests of the drain set their own).
os.environ.setdefault("SPECDEC_COST_PROFILE", "0")
os.environ.setdefault("SPECDEC_DRAIN_SECONDS", "2")
# Verifiers prefill 6 prompt tokens per step, so every end-to-end test with a longer prompt also
# runs chunked prefill (production default: 512).
os.environ.setdefault("SPECDEC_PREFILL_CHUNK", "6")

sys.path.insert(0, str(Path(__file__).parent))

from cluster import Cluster  # noqa: E402
from model_factory import make_checkpoint, make_layer_subset_draft  # noqa: E402


# CI runs the files on two workers (pytest-xdist --dist loadfile), handed out in collection order.
# The longest go first, so that neither worker is left alone with a long file at the end while
# the other idles (alphabetically, the tensor-parallel and training files came last). A file not
# listed keeps its place after them; a stale entry only changes the schedule.
LONG_FILES_FIRST = [
    "test_e2e_lossless.py", "test_e2e_failures.py", "test_e2e_sampling_distribution.py", "test_tensor_parallel.py",
    "test_embedded_model.py", "test_e2e_eagle3.py", "test_fuzz_requests.py", "test_replicas.py",
    "test_fault_injection.py", "test_train_drafter.py", "test_benchmarks.py", "test_serve_supervision.py",
    "test_docker.py", "test_health.py", "test_drain.py",
]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable: a file's own order is kept


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Targets of several shapes, and for each a one-layer draft derived from it."""
    root = tmp_path_factory.mktemp("checkpoints")
    out = {}
    for seed, shape in enumerate(["llama-gqa", "llama-tied", "qwen2-bias", "mistral"]):
        target = make_checkpoint(root / shape, shape, seed=seed)
        out[shape] = target
        out[f"{shape}/draft"] = make_layer_subset_draft(target, root / f"{shape}-draft", [0])
    return out


@pytest.fixture(scope="module")
def start_cluster(tmp_path_factory):
    clusters: list[Cluster] = []

    def start(target: Path, draft: Path | None, **kw) -> Cluster:
        c = Cluster(target, draft, log_dir=tmp_path_factory.mktemp("logs"), **kw)
        clusters.append(c)   # before start: a cluster that fails to start is stopped too
        return c.start()

    yield start
    for c in clusters:
        c.stop()

