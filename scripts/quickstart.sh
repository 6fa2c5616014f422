#!/usr/bin/env bash
# The main job on the embedded default model: install, start `specdec serve` (SmolLM2-135M-Instruct
# target, downloaded and converted once, drafted for by the shipped EAGLE-3 head), stream one answer, stop.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
PROMPT=${1:-"Explain speculative decoding in two sentences."}
LISTEN=127.0.0.1:${SPECDEC_PORT:-50051}
LOG=$(mktemp -t specdec-serve.XXXXXX.log)
.venv/bin/specdec serve --listen "$LISTEN" >"$LOG.out" 2>"$LOG" &
SERVE=$!
trap 'kill -TERM $SERVE 2>/dev/null; wait $SERVE 2>/dev/null || true' EXIT
echo "starting the services (first run downloads and converts the model; log: $LOG)" >&2
until grep -q "gateway listening on" "$LOG.out" 2>/dev/null; do
  kill -0 $SERVE 2>/dev/null || { echo "serve failed; see $LOG" >&2; tail -20 "$LOG" >&2; exit 1; }
  sleep 1
done
cat "$LOG.out" >&2
.venv/bin/specdec generate --gateway "$LISTEN" --chat --max-new-tokens 128 --json "$PROMPT"
