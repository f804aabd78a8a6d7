"""Sizes such as "40GiB" in bytes: the memory flags' parser, which imports nothing heavy (the command line checks
its flags with it before torch loads)."""

from __future__ import annotations

import re

MEMORY_UNITS = {
    "": 1,
    "B": 1,
    "KB": 1e3,
    "MB": 1e6,
    "GB": 1e9,
    "TB": 1e12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_memory(value) -> int:
    """Bytes from an int or a string such as "40GiB" or "500 MB"."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ValueError(f"max_memory must be positive, got {value}")
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", value, flags=re.IGNORECASE)
        if match:
            return int(float(match.group(1)) * MEMORY_UNITS[(match.group(2) or "").upper()])
        raise ValueError(f"max_memory {value!r} is not a size such as '40GiB' or '500MB'")
    raise TypeError(f"max_memory must be a number of bytes or a string such as '40GiB', got {type(value).__name__}")
