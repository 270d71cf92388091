"""pccl's numeric and on/off environment variables, read one way: unset or empty means
the default, and a value that is not one names the variable and what it takes (a bare
`int("")` says neither)."""
from __future__ import annotations

import math
import os
from typing import Optional


def count(name: str, env=os.environ) -> Optional[int]:
    """A positive integer (PCCL_RANKS_PER_NODE, PCCL_NICS_PER_NODE, ...), or None where
    unset or empty."""
    text = env.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{name} must be a positive integer, got {text!r}")
    return value


def seconds(name: str, default: float, env=os.environ) -> float:
    """A positive, finite number of seconds (PCCL_TIMEOUT), or `default` where unset or empty."""
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a positive number of seconds, got {text!r}")
    return value


def switch(name: str, default: bool, env=os.environ) -> bool:
    """0 or 1 (PCCL_CHECK_CALLS, ...), or `default` where unset or empty: another spelling
    ("true", "yes") is refused rather than read as off."""
    text = env.get(name, "").strip()
    if not text:
        return default
    if text not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {text!r}")
    return text == "1"
