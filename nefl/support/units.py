"""Sizes as people write them on command lines (300MB, 512MiB, 1.5GB): memory budgets, free disk to keep.

Stdlib only, so the small inference install's commands parse them too.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_size(text: str) -> int:
    """'300MB' (decimal), '300MiB' or '300M' (binary), '1.5GB', '4096' (bytes) -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read the size {text!r}; write e.g. 300MB, 512MiB, 1.5GB or a byte count")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
