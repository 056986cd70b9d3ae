"""Sizes as people write them ('512MiB', '2GiB', 'min', 'all') and as colibri prints
them. Standard library only: the daemon's configuration and colictl read sizes without
loading the storage stack."""

import re

from .errors import BudgetInvalid

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int | str:
    """'512MiB', '2GiB', '100k', '123456' -> bytes; 'min' and 'all' are returned as is.
    Raises BudgetInvalid."""
    t = str(text).strip().lower()
    if t in ("min", "all"):
        return t
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", t)
    if not m or m.group(2) not in _UNITS:
        raise BudgetInvalid(f"cannot read {text!r} as a size: use bytes or KiB/MiB/GiB (e.g. 512MiB), min or all")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def size_text(n: int | str) -> str:
    """A size as the configuration takes it back, exactly: 8388608 -> '8MiB', 1536 ->
    '1536', 'min' -> 'min'."""
    if isinstance(n, str):
        return n
    for unit, name in ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if n and n % unit == 0:
            return f"{n // unit}{name}"
    return str(n)


def fmt_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)
