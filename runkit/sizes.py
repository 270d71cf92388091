"""Byte sizes as people write them: "64", "4K", "1M", "2G", "64GB", "80GiB" (powers of 1024,
as memory capacities are counted: a "64 GB" GPU holds 64 GiB)."""
from __future__ import annotations

import re

UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from a size such as "64", "4K", "1M", "2G" or "64GB" (B or iB may follow a unit)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:([KMGT])(?:i?B)?|B?)\s*", str(text), re.IGNORECASE)
    if match is None:
        raise ValueError(f"size must be a whole number with an optional K, M, G or T suffix (B or iB may follow), "
                         f"got {text!r}")
    return int(match[1]) * UNITS[(match[2] or "").upper()]


def size_label(nbytes: int) -> str:
    """The shortest exact form: 16777216 -> "16M", 1000 -> "1000"."""
    for unit in ("G", "M", "K"):
        if nbytes >= UNITS[unit] and nbytes % UNITS[unit] == 0:
            return f"{nbytes // UNITS[unit]}{unit}"
    return str(nbytes)


def doubling_range(text: str, parse) -> list[int]:
    """"a" -> [a]; "a,b,c" -> [a, b, c]; "a:b" -> [a, 2a, 4a, ..., <= b]."""
    if ":" in text:
        lo, hi = (parse(part) for part in text.split(":", 1))
        if lo < 1 or hi < lo:
            raise ValueError(f"a range needs 1 <= start <= end, got {text!r}")
        out = [lo]
        while out[-1] * 2 <= hi:
            out.append(out[-1] * 2)
        return out
    return [parse(part) for part in text.split(",") if part.strip()]
