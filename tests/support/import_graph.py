"""The import graphs the documentation draws (README.md, docs/architecture.md), read back as
tables, so that tests/pccl/test_imports.py and tests/shard/test_imports.py hold each page to
the table they enforce."""
from __future__ import annotations

import re

from tests.support.docblocks import ROOT, blocks

PAGES = ("README.md", "docs/architecture.md")


def documented(page: str) -> dict[str, set[str]]:
    """{package: the packages it may import} from the import-graph blocks of `page` (marked
    "the import graph"): lines `a, b -> c, d`; a line without an arrow continues the one
    before; "(...)" is a comment."""
    table: dict[str, set[str]] = {}
    for block in blocks(ROOT / page):
        if not (block.marker and "the import graph" in block.marker):
            continue
        lines: list[str] = []
        for line in block.text.splitlines():
            if "->" in line or not lines:
                lines.append(line)
            else:
                lines[-1] += " " + line
        for line in lines:
            left, right = line.split("->")
            targets = {t.strip() for t in re.sub(r"\(.*?\)", "", right).split(",") if t.strip()}
            table.update((name.strip(), targets) for name in left.split(","))
    return table
