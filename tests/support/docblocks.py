"""The fenced blocks of the documentation and what their doc-test markers say to do with them
(tests/docs). A marker is an HTML comment on the line(s) just before a block's fence,
invisible when the page is rendered:

    <!-- doc-test: run with "-e 64M" -> "-e 1M", "--out DIR" -> "--out compare" -->
    <!-- doc-test: run -->
    <!-- doc-test: skip: needs Slurm (sbatch) -->
    <!-- doc-test: not a command: a sample of the log -->

A sh or bash block without a marker runs as it is; every other block needs one. "run with"
lists textual substitutions, each a JSON string -> a JSON string, applied to the block in
order; each must match at least once, so a block cannot drift away from its shortened form.
A python block marked run runs under the venv's python."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL = ("sh", "bash")
FENCE = re.compile(r"^\s*```(\S*)\s*$")
MARKER_START = "<!-- doc-test:"
STRING = r'"(?:[^"\\]|\\.)*"'
SUBSTITUTION = re.compile(rf"\s*({STRING})\s*->\s*({STRING})\s*(,|$)")


def doc_files() -> list[Path]:
    """The pages whose blocks are tested: README.md, docs/*.md and launch/README.md."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "launch" / "README.md"]


class MarkerError(ValueError):
    """A marker that is missing, malformed, or that does not fit its block."""


@dataclass
class Block:
    path: str            # relative to the repository
    line: int            # the opening fence's line, from 1
    lang: str            # the fence's language tag, "" if none
    text: str            # the lines between the fences, indentation of the fence removed
    marker: str | None   # the marker comment's text after "doc-test:", lines joined; None if none

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


@dataclass
class Plan:
    """What the marker says: "run" (with substitutions), "skip" or "not a command"."""
    kind: str
    reason: str = ""
    substitutions: list[tuple[str, str]] = field(default_factory=list)


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one page, each with the marker just above it. A doc-test comment
    that is not just above a fence is an error (a blank line between them detaches it)."""
    lines = path.read_text().split("\n")
    rel = str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)
    found, attached, i = [], set(), 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent = len(lines[i]) - len(lines[i].lstrip())
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        if end is None:
            raise MarkerError(f"{rel}:{i + 1}: a fence that is never closed")
        marker, start = None, i - 1
        if i > 0 and lines[i - 1].strip().endswith("-->"):
            while start > 0 and "<!--" not in lines[start]:   # a comment may span lines
                start -= 1
            if lines[start].strip().startswith(MARKER_START):
                comment = " ".join(s.strip() for s in lines[start:i])
                marker = comment[len(MARKER_START):-len("-->")].strip()
                attached.add(start)
        text = "\n".join(s[indent:] if s[:indent].strip() == "" else s for s in lines[i + 1:end])
        found.append(Block(rel, i + 1, m.group(1), text, marker))
        i = end + 1
    stray = [n for n, s in enumerate(lines) if s.strip().startswith(MARKER_START) and n not in attached]
    if stray:
        raise MarkerError(f"{rel}:{stray[0] + 1}: a doc-test marker not on the line just before a fence")
    return found


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path)]


def plan(block: Block) -> Plan:
    """The block's plan from its marker; MarkerError where it is missing or malformed."""
    where = block.id
    if block.marker is None:
        if block.lang in SHELL:
            return Plan("run")
        raise MarkerError(f"{where}: a ```{block.lang} block needs a doc-test marker on the line before it "
                          '(run, run with "..." -> "...", skip: reason, or not a command: reason)')
    m = re.fullmatch(r"(skip|not a command):\s*(.*)", block.marker, re.S)
    if m:
        if not m.group(2).strip():
            raise MarkerError(f"{where}: '{m.group(1)}:' needs a reason")
        return Plan(m.group(1), reason=m.group(2).strip())
    if block.lang not in (*SHELL, "python"):
        raise MarkerError(f"{where}: only sh, bash and python blocks run; this one is ```{block.lang}")
    if block.marker == "run":
        return Plan("run")
    if not block.marker.startswith("run with "):
        raise MarkerError(f"{where}: unknown marker {block.marker!r}")
    subs, rest = [], block.marker[len("run with "):]
    while rest.strip():
        m = SUBSTITUTION.match(rest)
        if not m:
            raise MarkerError(f'{where}: expected "old" -> "new" at {rest.strip()!r}')
        subs.append((json.loads(m.group(1)), json.loads(m.group(2))))
        rest = rest[m.end():]
    return Plan("run", substitutions=subs)


def commands(text: str) -> list[str]:
    """A script's commands: its lines, a line ending in a backslash joined to the next;
    blank and comment-only lines are not commands."""
    found, current = [], ""
    for line in text.split("\n"):
        current += line
        if line.endswith("\\"):
            current += "\n"
            continue
        if current.strip() and not current.lstrip().startswith("#"):
            found.append(current)
        current = ""
    if current.strip():
        found.append(current)
    return found


def identity(command: str) -> str | None:
    """What makes two commands of different pages the same run: their words without a
    trailing comment; None for one whose meaning depends on the lines before it (it reads
    a variable, or only sets some), which runs wherever it stands."""
    words = re.sub(r"\s#\s.*$", "", command.replace("\\\n", " ")).split()
    if any("$" in w for w in words) or all(re.fullmatch(r"\w+=\S*", w) for w in words):
        return None
    return " ".join(words)


def script(block: Block, p: Plan) -> str:
    """The block's text with the plan's substitutions made, each required to match."""
    text = block.text
    for old, new in p.substitutions:
        if old not in text:
            raise MarkerError(f"{block.id}: the substitution {old!r} -> {new!r} matches nothing in the block")
        text = text.replace(old, new)
    return text
