"""shard's architecture, checked as pccl's is (tests/pccl/test_imports.py): its sub-packages
import each other only down the layers tools -> planning -> engine -> pccl, wherever an
import stands (at module level or inside a function), pccl only through its public API
(PUBLIC), no command-line tool imports another, no chain of imports between shard's
modules comes back to where it started, and runkit, which both share, imports neither."""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

from tests.support.import_graph import PAGES, documented

ROOT = Path(__file__).resolve().parents[2]

# Who may import whom (docs/architecture.md). "facade" is `import shard`; "pccl" is pccl's
# public API: `import pccl` (pccl/__init__.py) and the packages it declares public.
PUBLIC = {"compression", "tuning", "distributed"}
ALLOWED = {
    "models": set(),
    "data": {"pccl"},
    "engine": {"pccl"},
    "planning": {"engine", "models", "pccl"},
    "tools": {"planning", "engine", "data", "models", "pccl"},
    "facade": {"engine"},
}
# The tools' command modules (the console scripts, and those run as python -m): each stands
# alone; they share only the helper modules beside them (run log, faults, preflight, ...).
COMMANDS = {"shard.tools.convergence", "shard.tools.checkpoint_bench"} | set(
    re.findall(r'^shard-[\w-]+ = "(shard[\w.]+):main"$', (ROOT / "pyproject.toml").read_text(), re.M))


def module_files():
    """(dotted name, path) of every module of shard."""
    for path in sorted((ROOT / "shard").rglob("*.py")):
        rel = path.relative_to(ROOT / "shard").with_suffix("").parts
        parts = ("shard",) + (rel[:-1] if rel[-1] == "__init__" else rel)
        yield ".".join(parts), path


def part_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "pccl":
        return "pccl" if len(parts) == 1 or parts[1] in PUBLIC else "pccl-internal"
    return "facade" if len(parts) == 1 else parts[1]


def imports(name: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """(imported shard or pccl module, line) for every import in `path`, wherever it stands;
    `from package import submodule` names the submodule (its package's facade is not the edge)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}:{node.lineno}: relative import; shard's are absolute"
            module = node.module
            for a in node.names:
                sub = f"{module}.{a.name}"
                found.append((sub if sub in known else module, node.lineno))
    return [(m, line) for m, line in found if m.split(".")[0] in ("shard", "pccl")]


def graph() -> dict[str, list[tuple[str, int, Path]]]:
    files = dict(module_files())
    known = set(files)
    return {name: [(m, line, path) for m, line in imports(name, path, known)] for name, path in files.items()}


def test_the_layers_have_no_cycle_and_cover_every_sub_package():
    order = TopologicalSorter({k: v - {"pccl"} for k, v in ALLOWED.items()}).static_order()
    assert set(order) == set(ALLOWED) - {"pccl"} | {"facade"}
    on_disk = {p.name for p in (ROOT / "shard").iterdir() if (p / "__init__.py").is_file()} | {"facade"}
    assert on_disk == set(ALLOWED), f"sub-packages {sorted(on_disk ^ set(ALLOWED))} are not in the layers"


def test_the_pages_draw_these_layers():
    """README.md and docs/architecture.md draw the shard lines of ALLOWED, no more, no less."""
    def spelled(part: str) -> str:
        return {"facade": "shard", "pccl": "pccl"}.get(part, f"shard.{part}")
    table = {spelled(k): {spelled(t) for t in v} for k, v in ALLOWED.items()}
    for page in PAGES:
        drawn = {k: v for k, v in documented(page).items() if k.startswith("shard")}
        assert drawn == table, page


def test_sub_packages_import_only_down_the_layers():
    wrong = []
    for name, edges in graph().items():
        mine = part_of(name)
        for target, line, path in edges:
            theirs = part_of(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {target} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_shard_reaches_pccl_through_its_public_api_only():
    """What test_sub_packages_import_only_down_the_layers holds, said once: pccl's runtime,
    executors, core and tools are its own."""
    inside = sorted({target for edges in graph().values() for target, _, _ in edges
                     if target.startswith("pccl") and part_of(target) != "pccl"})
    assert not inside, inside
    assert part_of("pccl.runtime.communicator") == part_of("pccl.tools.bench") == "pccl-internal"
    assert part_of("pccl") == part_of("pccl.tuning.profiles") == "pccl"


def test_runkit_imports_neither_pccl_nor_shard():
    wrong = [f"{path.relative_to(ROOT)}:{line}: {name}" for path in sorted((ROOT / "runkit").rglob("*.py"))
             for name, line in imports("runkit", path, set())]
    assert not wrong, wrong


def test_no_tool_imports_another_tools_command():
    wrong = [f"{path.relative_to(ROOT)}:{line}: imports the command {target}"
             for name, edges in graph().items() if part_of(name) == "tools"
             for target, line, path in edges if target in COMMANDS and target != name]
    assert not wrong, "\n".join(wrong)
    assert {"shard.tools.train", "shard.tools.compare", "shard.tools.strategy_plan"} <= COMMANDS


def test_shards_modules_import_each_other_without_a_cycle():
    """Every import counts, inside functions too: a lazy import that closes a circle fails."""
    edges = {name: {t for t, _, _ in out if t.startswith("shard") and t != name} for name, out in graph().items()}
    try:
        list(TopologicalSorter(edges).static_order())
    except CycleError as e:
        pytest.fail(f"an import cycle: {' -> '.join(e.args[1])}")


def test_the_checker_sees_a_lazy_import_up_the_layers_and_a_cycle(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from shard.planning.planner import make_plan\n")
    found = imports("shard.engine.bad", bad, {"shard.planning.planner"})
    assert found == [("shard.planning.planner", 2)]
    assert part_of(found[0][0]) not in ALLOWED["engine"]
    with pytest.raises(CycleError):
        list(TopologicalSorter({"a": {"b"}, "b": {"c"}, "c": {"a"}}).static_order())


def test_importing_the_engine_loads_no_planning_tools_or_models():
    code = ("import sys, shard, shard.engine\n"
            "up = sorted(m for m in sys.modules if m.startswith(('shard.planning', 'shard.tools', 'shard.models')))\n"
            "assert not up, up\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
