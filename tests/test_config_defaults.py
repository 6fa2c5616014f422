"""Verifier options whose default depends on the device: --hidden-states-fp8 and --fold-prefill
are on where the verifier runs on cuda (measured there, BENCHMARKS.md) and off on cpu. A flag or
its SPECDEC_* variable, either way, wins over the default. So does
--malloc-tuning's, on everywhere."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from specdec.config import EngineServiceConfig


def verifier(argv: list[str], device: str) -> EngineServiceConfig:
    p = argparse.ArgumentParser()
    EngineServiceConfig.add_arguments(p, "verifier")
    args = p.parse_args(argv)
    args.device = device   # as the CLI resolves it before building the config
    return EngineServiceConfig.from_args(args, "verifier", Path("/model"))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_fp8_and_fold_on_by_default_on_cuda_only(device):
    cfg = verifier([], device)
    assert (cfg.fold_prefill, cfg.hidden_states_fp8) == (device == "cuda", device == "cuda")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_flags_and_variables_win(device, monkeypatch):
    cfg = verifier(["--fold-prefill", "--no-hidden-states-fp8"], device)
    assert (cfg.fold_prefill, cfg.hidden_states_fp8) == (True, False)
    cfg = verifier(["--no-fold-prefill", "--hidden-states-fp8"], device)
    assert (cfg.fold_prefill, cfg.hidden_states_fp8) == (False, True)
    monkeypatch.setenv("SPECDEC_FOLD_PREFILL", "0")
    monkeypatch.setenv("SPECDEC_HIDDEN_STATES_FP8", "1")
    cfg = verifier([], device)
    assert (cfg.fold_prefill, cfg.hidden_states_fp8) == (False, True)
    monkeypatch.setenv("SPECDEC_FOLD_PREFILL", "1")
    monkeypatch.setenv("SPECDEC_HIDDEN_STATES_FP8", "0")
    cfg = verifier([], device)
    assert (cfg.fold_prefill, cfg.hidden_states_fp8) == (True, False)


def test_a_drafter_has_neither():
    p = argparse.ArgumentParser()
    EngineServiceConfig.add_arguments(p, "drafter")
    args = p.parse_args([])
    args.device = "cuda"
    cfg = EngineServiceConfig.from_args(args, "drafter", Path("/model"))
    assert not cfg.fold_prefill and not cfg.hidden_states_fp8


def test_malloc_tuning_on_unless_turned_off(monkeypatch):
    from specdec.config import GatewayConfig

    def gateway(argv: list[str]) -> GatewayConfig:
        p = argparse.ArgumentParser()
        GatewayConfig.add_arguments(p)
        return GatewayConfig.from_args(p.parse_args(argv), Path("/tokenizer"))

    assert verifier([], "cuda").malloc_tuning and gateway([]).malloc_tuning
    assert not verifier(["--no-malloc-tuning"], "cuda").malloc_tuning
    monkeypatch.setenv("SPECDEC_MALLOC_TUNING", "0")
    assert not verifier([], "cpu").malloc_tuning and not gateway([]).malloc_tuning
    assert verifier(["--malloc-tuning"], "cpu").malloc_tuning
