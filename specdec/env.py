"""SPECDEC_* environment variables: the defaults of every flag."""

from __future__ import annotations

import os


def env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"SPECDEC_{name}", default)
