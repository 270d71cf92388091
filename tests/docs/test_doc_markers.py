"""Every fenced block of the documentation is run by tests/docs/test_doc_commands.py or marked
with the reason it is not (tests/support/docblocks.py): a fast check, no launches, so a new
block without a marker, or a shortening substitution the doc has drifted away from, fails
make test and make test-fast."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import docblocks
from tests.support.docblocks import Block, MarkerError


def test_every_block_is_run_or_marked():
    problems = []
    for path in docblocks.doc_files():
        try:
            found = docblocks.blocks(path)
        except MarkerError as e:
            problems.append(str(e))
            continue
        for block in found:
            try:
                p = docblocks.plan(block)
                if p.kind == "run":
                    docblocks.script(block, p)
            except MarkerError as e:
                problems.append(str(e))
    assert not problems, "\n".join(problems)


def page(tmp_path: Path, text: str) -> list[Block]:
    path = tmp_path / "page.md"
    path.write_text(text)
    return docblocks.blocks(path)


def test_markers_are_read_from_the_lines_just_before_the_fence(tmp_path):
    shell, diagram, python, shortened = page(tmp_path, (
        "```sh\nls\n```\n"
        "<!-- doc-test: not a command:\n   a diagram -->\n```\na -> b\n```\n"
        "<!-- doc-test: skip: needs a GPU -->\n```python\nimport torch\n```\n"
        '  <!-- doc-test: run with "-n 8" -> "-n 2", "\\"x\\"" -> "y" -->\n'
        '  ```bash\n  mpiexec -n 8 echo "x"\n  ```\n'))
    assert docblocks.plan(shell).kind == "run"
    assert (docblocks.plan(diagram).kind, docblocks.plan(diagram).reason) == ("not a command", "a diagram")
    assert docblocks.plan(python).reason == "needs a GPU"
    p = docblocks.plan(shortened)
    assert p.substitutions == [("-n 8", "-n 2"), ('"x"', "y")]
    assert docblocks.script(shortened, p) == "mpiexec -n 2 echo y"


@pytest.mark.parametrize("text, error", [
    ("```\na -> b\n```\n", "needs a doc-test marker"),
    ("```python\nx = 1\n```\n", "needs a doc-test marker"),
    ("<!-- doc-test: skip: -->\n```sh\nsbatch x\n```\n", "needs a reason"),
    ("<!-- doc-test: runs -->\n```sh\nls\n```\n", "unknown marker"),
    ("<!-- doc-test: run with -n 8 -> -n 2 -->\n```sh\nls\n```\n", "expected"),
    ('<!-- doc-test: run with "-n 8" -> "-n 2" -->\n```sh\nls\n```\n', "matches nothing"),
    ("<!-- doc-test: run -->\n```\na -> b\n```\n", "only sh, bash and python blocks run"),
    ("<!-- doc-test: run -->\n\n```sh\nls\n```\n", "not on the line just before a fence"),
])
def test_a_missing_or_malformed_marker_is_an_error(tmp_path, text, error):
    with pytest.raises(MarkerError, match=error):
        for block in page(tmp_path, text):
            p = docblocks.plan(block)
            if p.kind == "run":
                docblocks.script(block, p)
