"""pccl's architecture, checked: the sub-packages import each other only down the layer
graph (so there is no import cycle, at module level or inside functions), tools share only
pccl.tools.cli, and the parts that need no MPI run where mpi4py and the native module
cannot be imported."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from graphlib import TopologicalSorter
from pathlib import Path

import pytest

from tests.support.import_graph import PAGES, documented

ROOT = Path(__file__).resolve().parents[2]
PCCL = ROOT / "pccl"

# Who may import whom (docs/architecture.md). "native" is the C++ extension pccl._native,
# "facade" the lazy top-level `import pccl`.
BELOW_TUNING = {"analysis", "vocabulary", "plans", "algorithms", "ir", "core"}
ALLOWED = {
    "core": set(),
    "ir": {"core"},
    "compression": {"core", "native"},
    "algorithms": {"ir", "core"},
    "plans": {"algorithms", "ir", "core"},
    "analysis": {"plans", "algorithms", "ir", "core"},
    "vocabulary": {"plans", "algorithms", "ir", "core"},
    "tuning": BELOW_TUNING | {"compression"},
    "executors": {"ir", "core", "native"},
    "runtime": {"executors", "tuning", "compression"} | BELOW_TUNING,
    "tools": {"runtime", "executors", "tuning", "compression", "native", "facade"} | BELOW_TUNING,
    "distributed": {"runtime", "core"},
}


def part_of(module: str) -> str:
    """The sub-package a dotted pccl module belongs to."""
    parts = module.split(".")
    if len(parts) == 1:
        return "facade"
    return "native" if parts[1] == "_native" else parts[1]


def pccl_imports(path: Path) -> list[tuple[str, int]]:
    """(imported pccl module, line) for every import in `path`, wherever it stands."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.split(".")[0] == "pccl"]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import; pccl imports are absolute"
            if node.module and node.module.split(".")[0] == "pccl":
                names = [node.module] if node.module != "pccl" else [f"pccl.{a.name}" for a in node.names]
                found += [(name, node.lineno) for name in names]
    return found


def modules():
    for path in sorted(PCCL.rglob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        if name != "pccl":  # the facade imports through importlib by name
            yield name, path


def test_the_layer_graph_has_no_cycle_and_covers_every_sub_package():
    order = list(TopologicalSorter({k: v - {"native", "facade"} for k, v in ALLOWED.items()}).static_order())
    assert set(order) == set(ALLOWED)
    on_disk = {p.name for p in PCCL.iterdir() if (p / "__init__.py").is_file()} | \
        {p.stem for p in PCCL.glob("*.py") if p.name != "__init__.py"}   # and top-level modules
    assert on_disk == set(ALLOWED), f"sub-packages {sorted(on_disk ^ set(ALLOWED))} are not in the layer graph"


def test_the_pages_draw_this_graph():
    """README.md and docs/architecture.md draw the pccl lines of ALLOWED, no more, no less."""
    spelled = {"native": "_native", "facade": "pccl"}
    table = {spelled.get(k, k): {spelled.get(t, t) for t in v} for k, v in ALLOWED.items()}
    for page in PAGES:
        drawn = {k: v for k, v in documented(page).items() if not k.startswith("shard")}
        assert drawn == table, page


def test_sub_packages_import_only_down_the_layer_graph():
    wrong = []
    for name, path in modules():
        mine = part_of(name)
        for target, line in pccl_imports(path):
            theirs = part_of(target)
            if theirs != mine and theirs not in ALLOWED[mine]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {mine} imports {target} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_tools_share_only_the_cli_helpers():
    wrong = []
    for name, path in modules():
        if part_of(name) != "tools":
            continue
        for target, line in pccl_imports(path):
            if part_of(target) == "tools" and target not in ("pccl.tools", "pccl.tools.cli"):
                wrong.append(f"{path.relative_to(ROOT)}:{line}: imports another tool, {target}")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from pccl.runtime.communicator import Communicator\n")
    assert pccl_imports(bad) == [("pccl.runtime.communicator", 2)]
    assert "runtime" not in ALLOWED["core"]


# A Python that cannot import mpi4py or the native module, as on a laptop without MPI.
BLOCKER = """
import importlib.abc, sys
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "mpi4py" or name == "pccl._native":
            raise ImportError(f"{name} is blocked in this test")
sys.meta_path.insert(0, Blocked())
"""


def run_blocked(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


def test_the_blocker_blocks():
    run = run_blocked("import mpi4py")
    assert run.returncode != 0 and "blocked in this test" in run.stderr


def test_import_pccl_loads_no_mpi_native_module_or_torch_distributed():
    run = run_blocked("""
import sys, pccl
assert pccl.Topology.regular(8, 4).num_nodes == 2
assert pccl.schedule("all_gather", "ring", 4, 0).size == 4
heavy = [m for m in ("mpi4py", "pccl._native", "torch.distributed") if m in sys.modules]
assert not heavy, heavy
print("ok")
""")
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_simulator_cost_model_and_verifier_run_without_mpi_or_the_native_module():
    run = run_blocked("""
import json, sys
import pccl
from pccl.analysis.verify import verify_plan
from pccl.tools import sim
from pccl.tuning.profiles import load
from pccl.tuning.selection import Tuner
tuner = Tuner(pccl.Topology.regular(64, 8, 4), load("frontier"), with_plans=True)
print(json.dumps({"choice": str(tuner.choose("all_gather", 1 << 20))}))
verify_plan(pccl.Hierarchical(), "reduce_scatter", pccl.Topology.regular(12, 4))
sim.main(["--profile", "frontier", "--collective", "all_gather", "--ranks", "256", "--size", "64M", "--json"])
import shard.data
assert "mpi4py" not in sys.modules and "pccl._native" not in sys.modules
""")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert json.loads(lines[0])["choice"]
    predicted = json.loads("\n".join(lines[1:]))
    assert predicted["ranks"] == 256 and predicted["algorithms"]["hierarchical"] > 0


@pytest.mark.parametrize("code", ["import pccl; pccl.init()", "from pccl.tools import bench"])
def test_what_needs_mpi_says_so_without_it(code):
    run = run_blocked(code)
    assert run.returncode != 0 and "mpi4py is blocked in this test" in run.stderr
