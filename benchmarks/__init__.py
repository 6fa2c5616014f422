"""One-command GPU benchmark suite: `python -m benchmarks.run --device cuda` (see run.py)."""
