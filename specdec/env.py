"""SPECDEC_* environment variables: the defaults of every flag."""

from __future__ import annotations

import os


def env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"SPECDEC_{name}", default)


def env_flag(name: str) -> bool | None:
    """A yes/no SPECDEC_* variable: None when unset (the flag's default then depends on the setup)."""
    value = env(name)
    return None if value is None else value.strip().lower() not in ("0", "false", "no", "off", "")
