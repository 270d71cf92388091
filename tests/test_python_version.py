"""The Python the project says it needs is the Python its code needs: pyproject.toml's
requires-python and ruff's target name one version, every file parses with that version's
grammar, and no file calls what the standard library added after it."""
from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = (ROOT / "pyproject.toml").read_text()
# What Python 3.11+ added that code here might reach for, as the code names it (an import,
# module.attribute, or a builtin); one of these fails on the oldest Python.
NEWER = {
    (3, 11): {"hashlib.file_digest", "tomllib", "ExceptionGroup", "BaseExceptionGroup", "enum.StrEnum",
              "asyncio.TaskGroup", "asyncio.timeout", "datetime.UTC", "typing.Self", "typing.Never",
              "typing.LiteralString", "typing.assert_never", "typing.reveal_type", "enum.verify"},
    (3, 12): {"itertools.batched", "typing.override"},
    (3, 13): {"copy.replace", "warnings.deprecated"},
}


def oldest() -> tuple[int, int]:
    floor = re.search(r'^requires-python = ">=(\d+)\.(\d+)"$', PYPROJECT, re.M)
    target = re.search(r'^target-version = "py(\d)(\d+)"$', PYPROJECT, re.M)
    assert floor and target, "pyproject.toml names requires-python and ruff's target-version"
    version = (int(floor[1]), int(floor[2]))
    assert (int(target[1]), int(target[2])) == version, "ruff's target-version is not requires-python's version"
    return version


def sources() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    return [ROOT / f for f in tracked] if tracked else sorted(p for p in ROOT.rglob("*.py") if ".venv" not in p.parts)


def test_every_file_parses_with_the_oldest_pythons_grammar():
    version = oldest()
    wrong = []
    for path in sources():
        try:
            ast.parse(path.read_text(), feature_version=version)
        except SyntaxError as e:
            wrong.append(f"{path.relative_to(ROOT)}:{e.lineno}: {e.msg}")
    assert not wrong, "\n".join(wrong)


def names_used(tree: ast.AST) -> set[str]:
    """Imported modules and names (module.name), module.attribute and bare names."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            out.add(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name):
            out.add(node.id)
    return out


def test_no_file_uses_what_the_standard_library_added_later():
    version = oldest()
    wrong = []
    for path in sources():
        used = names_used(ast.parse(path.read_text()))
        wrong += [f"{path.relative_to(ROOT)}: {name} needs Python {v[0]}.{v[1]}"
                  for v, listed in NEWER.items() if v > version for name in sorted(listed & used)]
    assert not wrong, "\n".join(wrong)


def test_the_checks_see_newer_python():
    assert oldest() < min(NEWER), "the lists above start after the floor; extend them with it"
    with pytest.raises(SyntaxError):
        ast.parse("try:\n    pass\nexcept* ValueError:\n    pass\n", feature_version=(3, 10))
    code = "import hashlib\nfrom typing import Self\nhashlib.file_digest(f, 'sha256')\n"
    assert {"hashlib.file_digest", "typing.Self"} <= names_used(ast.parse(code))
