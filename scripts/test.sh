#!/usr/bin/env bash
# Install (if needed) and run the test suite. GPU-only tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
