"""Generated stubs match protos/ (no drift), and `specdec serve` runs the three processes,
prints its ready line, serves `specdec generate --json`, and stops everything on SIGTERM."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import specdec.rpc
from cluster import free_port
from model_factory import hf_greedy
from specdec.rpc.protoc import compile_protos

REPO = Path(__file__).resolve().parents[1]


def test_installed_stubs_match_the_protos(tmp_path):
    shutil.copytree(REPO / "protos", tmp_path / "protos")
    for out in compile_protos(tmp_path):
        installed = Path(specdec.rpc.__file__).parent / out.relative_to(tmp_path / "specdec" / "rpc")
        for fresh in out.glob("*.py"):
            assert fresh.read_text() == (installed / fresh.name).read_text(), f"{fresh.name} drifted from protos/"


def test_serve_generate_and_stop(checkpoints):
    target, draft = checkpoints["llama-tied"], checkpoints["llama-tied/draft"]
    listen = f"127.0.0.1:{free_port()}"
    serve = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli", "serve", "--target", str(target), "--draft", str(draft),
         "--device", "cpu", "--dtype", "float64", "--listen", listen],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        line = serve.stdout.readline()
        assert line.strip() == f"gateway listening on {listen}"
        out = subprocess.run(
            [sys.executable, "-m", "specdec.cli", "generate", "--gateway", listen, "--token-ids", "4,8,15,16,23,42",
             "--max-new-tokens", "12", "--ignore-eos", "--mode", "tree", "--topk", "2", "--json"],
            capture_output=True, text=True, timeout=120, check=True,
        )
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["prompt_token_ids"] == [4, 8, 15, 16, 23, 42]
        assert result["output_token_ids"] == hf_greedy(target, [4, 8, 15, 16, 23, 42], 12)
        assert set(result["stats"]) >= {"steps", "drafted", "accepted", "mean_accepted_length",
                                        "overlap_hits", "overlap_misses"}
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0


def test_client_commands_start_without_torch():
    """`specdec health` (the containers' healthcheck, run every few seconds) and `specdec generate`
    build the whole command line but need no model code: building it once imported torch through
    train-drafter's defaults, 2.4 s and a few hundred MB a healthcheck."""
    code = ("import sys\nfrom specdec.cli import main\n"
            "try:\n    main(['health', '--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch loaded:', 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip().endswith("torch loaded: False")
