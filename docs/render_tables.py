"""Renders the benchmark tables of README.md and docs/*.md from benchmarks/results/*.json.

    python docs/render_tables.py            # rewrite every table between its markers (`make docs`)
    python docs/render_tables.py --check    # exit 1 naming every table that differs from its JSON

A generated table sits between two markers, invisible on a rendered page:

    <!-- table:engine_capacity -->
    | config | ... |
    <!-- /table -->

The name after `table:` is a function registered in docs/tables_*.py. A rerun of a benchmark
rewrites its JSON; `make docs` then updates every page that quotes it, and the test
tests/test_docs_tables.py fails while a committed table differs from what its JSON renders.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import tables_kernels  # noqa: E402, F401  (registers its tables)
import tables_quality  # noqa: E402, F401
import tables_serving  # noqa: E402, F401
from tables_fmt import TABLES  # noqa: E402

ROOT = HERE.parent
RESULTS = ROOT / "benchmarks" / "results"
# Markers start a line; an indented one (an example in a code block) is text.
BLOCK = re.compile(r"^(<!-- table:([\w-]+) -->\n)(.*?)^(<!-- /table -->)", re.S | re.M)
OPEN = re.compile(r"^<!-- table:([\w-]+) -->", re.M)


def pages(root: Path = ROOT) -> list[Path]:
    """README.md, benchmarks/README.md and every Markdown page under docs/."""
    extra = [p for p in (root / "benchmarks" / "README.md",) if p.exists()]
    return [root / "README.md", *extra, *sorted((root / "docs").rglob("*.md"))]


def render(text: str, results: Path = RESULTS, where: str = "") -> str:
    """`text` with every marked table rendered anew from `results`."""
    opened = OPEN.findall(text)
    closed = BLOCK.findall(text)
    if len(opened) != len(closed):
        raise ValueError(f"{where}: {len(opened)} table markers, {len(closed)} closed")

    def one(m: re.Match) -> str:
        name = m.group(2)
        if name not in TABLES:
            raise ValueError(f"{where}: unknown table {name!r}; known: {sorted(TABLES)}")
        body = "\n".join(TABLES[name](results))
        return f"{m.group(1)}{body}\n{m.group(4)}"

    return BLOCK.sub(one, text)


def stale(root: Path = ROOT, results: Path = RESULTS) -> list[str]:
    """'page: table' for every committed table that differs from what its JSON renders."""
    out = []
    for page in pages(root):
        text = page.read_text()
        fresh = render(text, results, where=str(page))
        if fresh != text:
            old = dict((n, b) for _, n, b, _ in BLOCK.findall(text))
            new = dict((n, b) for _, n, b, _ in BLOCK.findall(fresh))
            names = [n for n in new if old.get(n) != new[n]]
            out += [f"{page.relative_to(root)}: {n}" for n in names]
    return out


def main(argv: list[str] | None = None, root: Path = ROOT, results: Path = RESULTS) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail on a stale table; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        bad = stale(root, results)
        for line in bad:
            print(f"stale table (run `make docs`): {line}", file=sys.stderr)
        return 1 if bad else 0
    for page in pages(root):
        text = page.read_text()
        fresh = render(text, results, where=str(page))
        if fresh != text:
            page.write_text(fresh)
            print(f"updated {page.relative_to(root)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
