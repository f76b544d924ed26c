"""The registry and formatting helpers of the generated benchmark tables (docs/render_tables.py).

A table is a function of the results folder that returns Markdown lines; `@table("name")`
registers it under the name its markers use (`<!-- table:name -->`). Plain Python, no JAX.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

TABLES: dict[str, Callable[[Path], list[str]]] = {}


def table(name: str):
    """Registers a table function under `name`."""

    def register(fn):
        if name in TABLES:
            raise ValueError(f"{name=} is registered twice")
        TABLES[name] = fn
        return fn

    return register


def load(results: Path, stem: str) -> dict:
    """`results/<stem>.json`, parsed."""
    return json.loads((results / f"{stem}.json").read_text())


def num(x, digits: int = 0) -> str:
    """`x` rounded to `digits` decimals with thousands separators; '—' for None."""
    if x is None:
        return "—"
    return f"{x:,.{digits}f}"


def pct(ratio: float) -> str:
    """0.25 -> '25%'."""
    return f"{ratio * 100:g}%"


def gb(n_bytes: float, digits: int = 2) -> str:
    """Bytes as decimal GB."""
    return num(n_bytes / 1e9, digits)


def gib(n_bytes: float, digits: int = 2) -> str:
    """Bytes as GiB."""
    return num(n_bytes / 2**30, digits)


def md(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"{row=} has {len(row)} cells, the header {len(header)}")
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return lines


def one(rows: list[dict], **match) -> dict:
    """The one row whose fields equal `match`; a ValueError naming `match` otherwise."""
    found = [r for r in rows if all(r.get(k) == v for k, v in match.items())]
    if len(found) != 1:
        raise ValueError(f"{match=} matches {len(found)} rows, expected 1")
    return found[0]
