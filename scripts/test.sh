#!/usr/bin/env bash
# Install (if needed) and run the test suite. GPU-only tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
# Two workers, one test file each at a time: most of a test's time is processes starting and
# waiting on each other, so two files in parallel use the second core (a module's cluster stays in
# its worker).
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist loadfile "$@"
