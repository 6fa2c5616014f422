"""scripts/bench_serve.py's configurations: the named rows, and any chain or tree spelled out the
same way (what the tree-size and chain k=1 rows of BENCHMARKS.md ran), with a clear refusal of the rest."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("bench_serve", Path(__file__).parents[1] / "scripts" / "bench_serve.py")
bench_serve = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench_serve)


def test_named_and_spelled_out_configs():
    assert bench_serve.config("tree topk=4") == ("tree", {"topk": 4, "depth": 5, "budget": 16})
    assert bench_serve.config("tree topk=8 depth=6 budget=32") == ("tree", {"topk": 8, "depth": 6, "budget": 32})
    assert bench_serve.config("tree budget=8") == ("tree", {"topk": 4, "depth": 5, "budget": 8})
    assert bench_serve.config("chain k=1") == ("chain", {"k": 1})
    assert bench_serve.config("chain k=1 no-overlap") == ("chain", {"k": 1, "overlap": False})
    assert bench_serve.config("auto") == ("auto", {})
    assert bench_serve.CONFIGS["tree topk=4"][1]["budget"] == 16   # not changed by the spelled-out ones


@pytest.mark.parametrize("name, complaint", [("treex", "unknown config"), ("tree k=3", "not one of tree's sizes"),
                                             ("chain k=two", "not one of chain's sizes"), ("off k=2", "unknown config"),
                                             ("tree no-overlap", "not one of tree's sizes")])
def test_unknown_configs_are_refused(name, complaint):
    with pytest.raises(argparse.ArgumentTypeError, match=complaint):
        bench_serve.config(name)
