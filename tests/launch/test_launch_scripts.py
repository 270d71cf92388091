"""The launch scripts (launch/): they parse, and with DRY_RUN=1 print the right environment
and command lines under a fake Slurm environment (no cluster here). Printed commands are
read back with shlex.split and checked token by token."""
from __future__ import annotations

import os
import shlex
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pccl.core.topology import FRONTIER_ENV, MACHINES
from runkit.mpirun import launcher

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = ROOT / "launch"
SCRIPTS = ["local.sh", "frontier.sbatch", "perlmutter.sbatch", "torchrun.sh"]
# Variables of a surrounding job or of the caller that the scripts read.
SCRUB = ("SLURM_", "MASTER_", "NNODES", "NPROC", "RANKS_PER_NODE", "MODEL", "STRATEGY", "COMM", "RESTARTS",
         "DEVICE", "PYTHON", "MPIEXEC", "TORCHRUN", "OMP_NUM_THREADS", "DRY_RUN", "MODULES",
         "SRUN_ARGS", "REPO", "CPUS_PER_TASK", "GPU_BIND", "RDZV_ID", "PMI_", "OMPI_", "HYDRA_")
USER = ["train.steps=100", "train.out_dir=runs/x y", "optim.lr=3e-4", "+extra='quoted'"]


def run(script: str, *args: str, dry: bool = True, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB)}
    base.update(PYTHON=sys.executable)
    if dry:
        base["DRY_RUN"] = "1"
    base.update(env)
    return subprocess.run(["bash", str(LAUNCH / script), *args], env=base, capture_output=True,
                          text=True, timeout=30, cwd=ROOT, preexec_fn=as_at_a_terminal)


def as_at_a_terminal() -> None:
    """SIGINT at its default, as a user's shell has it: a suite started in the background
    (`make test &`) inherits it ignored, and bash cannot trap a signal ignored on entry, so
    local.sh's Ctrl-C test restarted the run it should have left stopped."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def parsed(proc: subprocess.CompletedProcess) -> tuple[dict, list, list]:
    """(exported variables, the command's words, comment lines) of a dry run."""
    assert proc.returncode == 0, proc.stderr
    exports, command, comments = {}, None, []
    for line in proc.stdout.splitlines():
        if line.startswith("#"):
            comments.append(line)
        elif line.startswith("export "):
            key, _, value = line[len("export "):].partition("=")
            (exports[key],) = shlex.split(value)
        elif line.strip():
            assert command is None, f"more than one command line:\n{proc.stdout}"
            command = shlex.split(line)
    assert command is not None, proc.stdout
    return exports, command, comments


def opt(words: list, name: str) -> str:
    """The value of `name` given as `--name=value` or `name value`."""
    for i, w in enumerate(words):
        if w.startswith(name + "="):
            return w[len(name) + 1:]
        if w == name:
            return words[i + 1]
    raise AssertionError(f"{name} not in {words}")


def trainer_args(words: list) -> list:
    i = words.index("-m")
    assert words[i + 1] == "shard.tools.train", words
    return words[i + 2:]


def overrides(words: list) -> dict:
    return dict(a.split("=", 1) for a in trainer_args(words))


def fail(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode != 0, proc.stdout
    assert proc.stdout == ""
    for f in fragments:
        assert f in proc.stderr, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_parses_and_is_executable(script):
    path = LAUNCH / script
    assert path.stat().st_mode & stat.S_IXUSR
    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    text = path.read_text()
    assert text.startswith("#!") and "set -euo pipefail" in text and "DRY_RUN" in text
    assert script in (LAUNCH / "README.md").read_text()



def test_shared_helpers_are_in_common_sh_only():
    """Every script sources launch/common.sh, and each helper is defined in one file only
    (find_repo, which the sbatch scripts need before common.sh can be found, excepted)."""
    import re
    defined = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*\(\)\s*\{", re.M)
    common = LAUNCH / "common.sh"
    proc = subprocess.run(["bash", "-n", str(common)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    shared = set(defined.findall(common.read_text()))
    assert {"die", "is_posint", "has_override", "quote_words", "default_python", "load_modules"} <= shared
    where: dict[str, list[str]] = {}
    for script in SCRIPTS:
        text = (LAUNCH / script).read_text()
        assert re.search(r'^source "\$[A-Z]+/launch/common\.sh"$', text, re.M), script
        names = defined.findall(text)
        assert not set(names) & shared, (script, set(names) & shared)
        for name in names:
            where.setdefault(name, []).append(script)
    assert {n: s for n, s in where.items() if len(s) > 1} == {
        "find_repo": ["frontier.sbatch", "perlmutter.sbatch"]}


@pytest.mark.parametrize("script", ["frontier.sbatch", "perlmutter.sbatch"])
def test_sbatch_copy_finds_the_checkout(script, tmp_path):
    """Slurm runs a copy of the script from its spool directory: the checkout (and its
    launch/common.sh) is found through SLURM_SUBMIT_DIR, or REPO, else a clear error."""
    copy = tmp_path / script
    copy.write_text((LAUNCH / script).read_text())
    job = dict(SLURM_NNODES="2", SLURM_JOB_ID="99")   # a job's id: the same out_dir in every run
    expected = parsed(run(script, "train.steps=5", **job))
    for env in ({"SLURM_SUBMIT_DIR": str(ROOT)}, {"SLURM_SUBMIT_DIR": str(LAUNCH)},
                {"SLURM_SUBMIT_DIR": str(tmp_path), "REPO": str(ROOT)}):
        assert parsed(run(str(copy), "train.steps=5", **job, **env)) == expected, env
    fail(run(str(copy), SLURM_NNODES="2", SLURM_SUBMIT_DIR=str(tmp_path)), f"{script}: error", "REPO")

# --- Frontier -------------------------------------------------------------------------

def test_frontier_srun_line_and_environment():
    env, words, comments = parsed(run("frontier.sbatch", *USER, SLURM_NNODES="4", MODEL="gpt_7b",
                                      STRATEGY="paro-iig"))
    machine = MACHINES["frontier"]
    assert words[0] == "srun"
    assert opt(words, "-N") == "4"
    assert opt(words, "-n") == "32"
    assert opt(words, "--ntasks-per-node") == str(machine["ranks_per_node"]) == "8"
    assert opt(words, "--gpus-per-node") == "8"
    assert opt(words, "--gpu-bind") == "closest"
    assert opt(words, "-c") == "7"
    assert words[words.index("-m") - 1] == sys.executable
    args = trainer_args(words)
    assert args[-len(USER):] == USER  # passed through unchanged, in order
    assert overrides(words) == {**dict(a.split("=", 1) for a in USER), "comm.ranks_per_node": "8",
                                     "train.device": "cuda", "model": "gpt_7b", "strategy": "paro-iig",
                                     "comm": "pccl", "train.resume": "auto"}
    # The paper's environment, exactly pccl.core.topology.FRONTIER_ENV, plus MPI's thread
    # safety, the NIC count and threads.
    assert {k: v for k, v in env.items() if k in FRONTIER_ENV} == FRONTIER_ENV
    assert set(env) - set(FRONTIER_ENV) == {"MPICH_MAX_THREAD_SAFETY", "PCCL_NICS_PER_NODE", "OMP_NUM_THREADS"}
    assert env["MPICH_MAX_THREAD_SAFETY"] == "multiple"
    assert env["PCCL_NICS_PER_NODE"] == str(machine["nics_per_node"])
    assert env["OMP_NUM_THREADS"] == "7"
    # Modules are shown, not loaded, in a dry run (there is no `module` here).
    assert any("module load" in c and "rocm" in c and "cray-mpich" in c for c in comments)


def test_frontier_environment_has_one_source(tmp_path):
    """The exported variables are read from pccl/core/topology.py, not written in the script."""
    (tmp_path / "pccl" / "core").mkdir(parents=True)
    (tmp_path / "pccl" / "core" / "topology.py").write_text(
        "FRONTIER_ENV = {'MPICH_OFI_NIC_MAPPING': '0:0;1:1', 'ONLY_HERE': 'a b;c'}\n")
    env, _, _ = parsed(run("frontier.sbatch", SLURM_NNODES="1", REPO=str(tmp_path)))
    assert env == {"MPICH_OFI_NIC_MAPPING": "0:0;1:1", "ONLY_HERE": "a b;c", "MPICH_MAX_THREAD_SAFETY": "multiple",
                   "PCCL_NICS_PER_NODE": "4", "OMP_NUM_THREADS": "7"}


def test_frontier_parameters():
    env, words, comments = parsed(run("frontier.sbatch", "model=gpt_13b", "comm=torch", SLURM_NNODES="2",
                                      RANKS_PER_NODE="4", CPUS_PER_TASK="14", MODULES="",
                                      SRUN_ARGS="--cpu-bind=verbose --exclusive", OMP_NUM_THREADS="3"))
    assert opt(words, "-n") == "8" and opt(words, "--ntasks-per-node") == "4" and opt(words, "-c") == "14"
    # 4 ranks a node: each its own NIC, as pccl's model has them (not the 8-rank pairs)
    assert (env["MPICH_OFI_NIC_MAPPING"], env["PCCL_NICS_PER_NODE"]) == ("0:0;1:1;2:2;3:3", "4")
    two, _, _ = parsed(run("frontier.sbatch", SLURM_NNODES="2", RANKS_PER_NODE="2", MODULES=""))
    assert (two["MPICH_OFI_NIC_MAPPING"], two["PCCL_NICS_PER_NODE"]) == ("0:0;1:1", "2")
    assert words.index("--cpu-bind=verbose") + 1 == words.index("--exclusive") < words.index("-m")
    # An override among the arguments replaces the script's own (no duplicate keys for Hydra).
    args = trainer_args(words)
    assert args[:3] + args[-2:] == ["comm.ranks_per_node=4", "train.device=cuda", "strategy=zero3",
                                    "model=gpt_13b", "comm=torch"]
    assert args[3].startswith("train.out_dir=runs/slurm-") and args[4] == "train.resume=auto"   # no SLURM_JOB_ID
    assert env["OMP_NUM_THREADS"] == "3" and comments == []


@pytest.mark.parametrize("env, message", [
    ({}, "sbatch -N"),
    ({"SLURM_NNODES": "two"}, "positive integer"),
    ({"SLURM_NNODES": "2", "RANKS_PER_NODE": "9"}, "RANKS_PER_NODE"),
    ({"SLURM_NNODES": "2", "RANKS_PER_NODE": "0"}, "RANKS_PER_NODE"),
    ({"SLURM_NNODES": "2", "DRY_RUN": "yes"}, "DRY_RUN"),
])
def test_frontier_errors(env, message):
    fail(run("frontier.sbatch", **env), "frontier.sbatch: error", message)


# --- Perlmutter -----------------------------------------------------------------------

def test_perlmutter_srun_line_and_environment():
    env, words, comments = parsed(run("perlmutter.sbatch", *USER, SLURM_NNODES="4", COMM="torch"))
    machine = MACHINES["perlmutter"]
    assert words[0] == "srun"
    assert opt(words, "-N") == "4" and opt(words, "-n") == "16"
    assert opt(words, "--ntasks-per-node") == str(machine["ranks_per_node"]) == "4"
    assert opt(words, "--gpus-per-node") == "4" and opt(words, "--gpu-bind") == "none"
    assert opt(words, "-c") == "32"
    assert trainer_args(words)[-len(USER):] == USER
    o = overrides(words)
    assert (o["comm.ranks_per_node"], o["train.device"], o["comm"]) == ("4", "cuda", "torch")
    assert (o["model"], o["strategy"]) == ("gpt_1p3b", "zero3")
    assert env == {"MPICH_GPU_SUPPORT_ENABLED": "1", "MPICH_MAX_THREAD_SAFETY": "multiple", "OMP_NUM_THREADS": "16",
                   "PCCL_NICS_PER_NODE": str(machine["nics_per_node"])}
    assert any("module load" in c for c in comments)


def test_perlmutter_parameters_and_errors():
    _, words, _ = parsed(run("perlmutter.sbatch", SLURM_NNODES="3", GPU_BIND="closest", MODEL="",
                             STRATEGY="ddp"))
    assert opt(words, "-n") == "12" and opt(words, "--gpu-bind") == "closest"
    assert "model" not in overrides(words) and overrides(words)["strategy"] == "ddp"
    fail(run("perlmutter.sbatch", SLURM_NNODES="3", GPU_BIND="single"), "GPU_BIND")
    fail(run("perlmutter.sbatch", SLURM_NNODES="3", RANKS_PER_NODE="8"), "RANKS_PER_NODE")
    fail(run("perlmutter.sbatch"), "sbatch -N")


@pytest.mark.parametrize("script", ["frontier.sbatch", "perlmutter.sbatch"])
def test_sbatch_jobs_resume_after_a_requeue_and_restart_srun(script, tmp_path):
    """A job's output directory is runs/slurm-<job id>, the same when Slurm requeues it, and
    it resumes (train.resume=auto) unless told otherwise; RESTARTS=N relaunches a failing
    srun up to N times (a fake srun fails its first call)."""
    o = overrides(parsed(run(script, SLURM_NNODES="2", SLURM_JOB_ID="4242"))[1])
    assert (o["train.out_dir"], o["train.resume"]) == ("runs/slurm-4242", "auto")
    o = overrides(parsed(run(script, "train.resume=false", "train.out_dir=mine", SLURM_NNODES="2",
                             SLURM_JOB_ID="4242"))[1])
    assert (o["train.out_dir"], o["train.resume"]) == ("mine", "false")
    fail(run(script, "train.resume=true", SLURM_NNODES="2", RESTARTS="1"), "RESTARTS sets train.resume=auto")
    fail(run(script, SLURM_NNODES="2", RESTARTS="x"), "RESTARTS must be an integer >= 0")
    # more nodes than the job has (srun -N 8 of 4), a REPO without pccl (a traceback, or a silent fallback)
    fail(run(script, NNODES="8", SLURM_NNODES="4"), "NNODES=8 exceeds the job's 4 node(s)")
    fail(run(script, SLURM_NNODES="2", REPO="/nonexistent"), "REPO=/nonexistent holds no pccl checkout")
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    calls.write_text("0")
    (bin_dir / "srun").write_text(f'#!/bin/bash\nn=$(( $(cat {calls}) + 1 )); echo $n > {calls}\n'
                                  f'printf "%s\\n" "$@" >> {tmp_path / "argv"}\n(( n > 1 )) || exit 3\n')
    (bin_dir / "srun").chmod(0o755)
    proc = run(script, dry=False, SLURM_NNODES="2", SLURM_JOB_ID="4242", RESTARTS="1", MODULES="",
               PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 0 and calls.read_text().strip() == "2", proc.stderr
    assert "restart 1 of 1 with train.resume=auto" in proc.stderr
    assert (tmp_path / "argv").read_text().count("train.resume=auto") == 2


# --- torchrun -------------------------------------------------------------------------

@pytest.fixture
def fake_scontrol(tmp_path):
    """A `scontrol show hostnames` that expands nid[001000-001003] and logs its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/bash\necho "$@" >> {shlex.quote(str(log))}\n'
                      'printf "nid%06d\\n" 1000 1001 1002 1003\n')
    script.chmod(0o755)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}, log


def test_torchrun_under_slurm(fake_scontrol):
    path, log = fake_scontrol
    _, words, _ = parsed(run("torchrun.sh", *USER, SLURM_NNODES="4", SLURM_JOB_NODELIST="nid[001000-001003]",
                             SLURM_JOB_ID="777", SLURM_GPUS_ON_NODE="8", **path))
    assert Path(words[0]).name == "torchrun" or words[1:3] == ["-m", "torch.distributed.run"]
    assert opt(words, "--nnodes") == "4" and opt(words, "--nproc-per-node") == "8"
    assert opt(words, "--rdzv-backend") == "c10d"
    assert opt(words, "--rdzv-endpoint") == "nid001000:29500"
    assert opt(words, "--rdzv-id") == "777"
    assert log.read_text().split() == ["show", "hostnames", "nid[001000-001003]"]
    assert trainer_args(words)[-len(USER):] == USER
    o = overrides(words)
    assert (o["comm"], o["comm.ranks_per_node"], o["train.device"]) == ("torch", "8", "cuda")
    # a requeued job resumes: in the out_dir given, else in the job's own
    assert o["train.resume"] == "auto" and o["train.out_dir"] == "runs/x y"
    _, words, _ = parsed(run("torchrun.sh", SLURM_NNODES="4", SLURM_JOB_NODELIST="nid[001000-001003]",
                             SLURM_JOB_ID="777", SLURM_GPUS_ON_NODE="8", **path))
    assert (overrides(words)["train.out_dir"], overrides(words)["train.resume"]) == ("runs/slurm-777", "auto")


def test_torchrun_in_a_step_on_part_of_the_job_meets_on_its_own_nodes(fake_scontrol):
    """srun -N 2 inside a job of 4 nodes: the rendezvous host is the step's first node, the
    nodes are the step's, and the id names the step, so two steps of one job meet apart."""
    path, log = fake_scontrol
    _, words, _ = parsed(run("torchrun.sh", SLURM_JOB_NODELIST="nid[001000-001003]", SLURM_JOB_NUM_NODES="4",
                             SLURM_NODELIST="nid[001002-001003]", SLURM_STEP_NODELIST="nid[001002-001003]",
                             SLURM_NNODES="2", SLURM_STEP_NUM_NODES="2", SLURM_JOB_ID="777", SLURM_STEP_ID="3",
                             SLURM_GPUS_ON_NODE="8", **path))
    assert log.read_text().split() == ["show", "hostnames", "nid[001002-001003]"]
    assert opt(words, "--nnodes") == "2" and opt(words, "--rdzv-id") == "777.3"


def test_torchrun_parameters(fake_scontrol):
    path, log = fake_scontrol
    _, words, _ = parsed(run("torchrun.sh", SLURM_NNODES="2", SLURM_JOB_NODELIST="nid[001000-001001]",
                             NPROC_PER_NODE="4", MASTER_ADDR="10.0.0.9", MASTER_PORT="6000",
                             TORCHRUN="python -m torch.distributed.run", TORCHRUN_ARGS="--max-restarts=0",
                             **path))
    assert words[:3] == ["python", "-m", "torch.distributed.run"] and "--max-restarts=0" in words
    assert opt(words, "--rdzv-endpoint") == "10.0.0.9:6000" and opt(words, "--nproc-per-node") == "4"
    assert not log.exists()  # MASTER_ADDR given: no host lookup
    # One node outside Slurm: a local rendezvous.
    _, words, _ = parsed(run("torchrun.sh", NPROC_PER_NODE="2"))
    assert opt(words, "--nnodes") == "1" and opt(words, "--rdzv-endpoint") == "127.0.0.1:29500"


def test_torchrun_restarts_every_rank_with_resume_auto(fake_scontrol):
    path, _ = fake_scontrol
    _, words, _ = parsed(run("torchrun.sh", NPROC_PER_NODE="2", RESTARTS="3"))
    o = overrides(words)
    assert opt(words, "--max-restarts") == "3" and o["train.resume"] == "auto"
    assert o["train.out_dir"].startswith("runs/")
    _, words, _ = parsed(run("torchrun.sh", SLURM_NNODES="4", SLURM_JOB_NODELIST="nid[001000-001003]",
                             SLURM_JOB_ID="777", SLURM_GPUS_ON_NODE="8", RESTARTS="1", **path))
    assert overrides(words)["train.out_dir"] == "runs/slurm-777"   # one directory for every node
    assert "--max-restarts" not in " ".join(parsed(run("torchrun.sh", NPROC_PER_NODE="2"))[1])
    fail(run("torchrun.sh", NNODES="2", MASTER_ADDR="node0", NPROC_PER_NODE="4", RESTARTS="1"),
         "RESTARTS needs one output directory")


@pytest.mark.parametrize("env, message", [
    ({"NNODES": "2", "NPROC_PER_NODE": "4"}, "MASTER_ADDR"),
    ({"NPROC_PER_NODE": "0"}, "NPROC_PER_NODE must be a positive integer"),
    ({"NPROC_PER_NODE": "4", "NNODES": "x"}, "NNODES"),
    ({"NPROC_PER_NODE": "4", "MASTER_PORT": "70000"}, "MASTER_PORT"),
])
def test_torchrun_errors(env, message):
    fail(run("torchrun.sh", **env), "torchrun.sh: error", message)


# --- local ----------------------------------------------------------------------------

def test_local_mpiexec_line():
    env, words, _ = parsed(run("local.sh", *USER, NPROC="8", RANKS_PER_NODE="4"))
    prefix = list(launcher())  # the mpiexec next to this interpreter, with its flags
    assert words[:len(prefix)] == prefix
    assert words[len(prefix):len(prefix) + 3] == ["-n", "8", sys.executable]
    assert trainer_args(words) == ["comm.ranks_per_node=4", "train.device=auto", "model=tiny",
                                   "strategy=zero3", "comm=pccl", *USER]
    assert env == {"OMP_NUM_THREADS": "1"}


def test_local_defaults_and_overrides():
    env, words, _ = parsed(run("local.sh", "model=gpt_125m", COMM="native", OMP_NUM_THREADS="4"))
    assert opt(words, "-n") == "2"
    assert trainer_args(words) == ["train.device=auto", "strategy=zero3", "comm=native", "model=gpt_125m"]
    assert env == {"OMP_NUM_THREADS": "4"}
    env, words, _ = parsed(run("local.sh", DEVICE="cuda", MPIEXEC_ARGS="-bind-to none"))
    assert overrides(words)["train.device"] == "cuda" and env == {}
    assert words.index("-bind-to") + 2 == words.index("-n")
    # one rank on the CPU (make train) leaves the threads to shard-train: every core it may use
    env, words, _ = parsed(run("local.sh", NPROC="1"))
    assert opt(words, "-n") == "1" and env == {}


@pytest.mark.parametrize("env, message", [
    ({"NPROC": "0"}, "NPROC must be a positive integer, got '0'"),
    ({"NPROC": "-4"}, "NPROC must be a positive integer"),
    ({"NPROC": "two"}, "NPROC must be a positive integer"),
    ({"NPROC": "2.5"}, "NPROC must be a positive integer"),
    ({"NPROC": "6", "RANKS_PER_NODE": "4"}, "NPROC (6) must be divisible by RANKS_PER_NODE (4)"),
    ({"NPROC": "4", "RANKS_PER_NODE": "x"}, "RANKS_PER_NODE must be a positive integer"),
    ({"DEVICE": "gpu"}, "DEVICE"),
    ({"PYTHON": "/nonexistent/python"}, "PYTHON"),
    ({"RESTARTS": "-1"}, "RESTARTS must be an integer >= 0, got '-1'"),
    ({"RESTARTS": "two"}, "RESTARTS must be an integer >= 0"),
    ({"RESTARTS": "010"}, "RESTARTS must be an integer >= 0, got '010'"),   # bash read it as octal 8
])
def test_local_errors(env, message):
    fail(run("local.sh", **env), "local.sh: error", message)


def test_local_runs_the_printed_command(tmp_path):
    """DRY_RUN=0 executes exactly what DRY_RUN=1 prints (a fake mpiexec records its words)."""
    log = tmp_path / "argv"
    fake = tmp_path / "mpiexec"
    fake.write_text(f'#!/bin/bash\n[[ $1 == --version ]] && {{ echo "fake MPI"; exit 0; }}\n'
                    f'printf "%s\\n" "$OMP_NUM_THREADS" "$@" > {shlex.quote(str(log))}\n')
    fake.chmod(0o755)
    args = dict(NPROC="4", RANKS_PER_NODE="2", MPIEXEC=str(fake))
    _, printed, _ = parsed(run("local.sh", *USER, **args))
    proc = run("local.sh", *USER, dry=False, **args)
    assert proc.returncode == 0, proc.stderr
    threads, *argv = log.read_text().splitlines()
    assert threads == "1" and [str(fake), *argv] == printed


def test_local_restarts_a_failed_run_with_resume_auto(tmp_path):
    """RESTARTS=N relaunches a failing run up to N times, every attempt with
    train.resume=auto and one output directory (a fake mpiexec fails its first calls)."""
    calls, log = tmp_path / "calls", tmp_path / "argv"
    fake = tmp_path / "mpiexec"

    def fake_failing(times: int) -> None:
        calls.write_text("0")
        fake.write_text(f'#!/bin/bash\n[[ $1 == --version ]] && {{ echo "fake MPI"; exit 0; }}\n'
                        f'n=$(( $(cat {calls}) + 1 )); echo $n > {calls}\n'
                        f'printf "%s\\n" "$@" >> {shlex.quote(str(log))}\n'
                        f'(( n > {times} )) || exit 7\n')
        fake.chmod(0o755)

    fake_failing(2)
    _, printed, _ = parsed(run("local.sh", "train.steps=3", MPIEXEC=str(fake), RESTARTS="2"))
    assert overrides(printed)["train.resume"] == "auto" and overrides(printed)["train.out_dir"].startswith("runs/")
    proc = run("local.sh", "train.steps=3", "train.out_dir=runs/mine", dry=False, MPIEXEC=str(fake), RESTARTS="2")
    assert proc.returncode == 0 and calls.read_text().strip() == "3", proc.stderr
    assert "restart 1 of 2 with train.resume=auto" in proc.stderr and "restart 2 of 2" in proc.stderr
    assert log.read_text().count("train.resume=auto") == 3 and log.read_text().count("train.out_dir=runs/mine") == 3
    fake_failing(5)
    proc = run("local.sh", dry=False, MPIEXEC=str(fake), RESTARTS="1")
    assert proc.returncode == 7 and calls.read_text().strip() == "2"
    assert "failed (exit 7) after 1 restart(s); giving up" in proc.stderr
    fail(run("local.sh", "train.resume=true", RESTARTS="1"), "RESTARTS sets train.resume=auto itself")
    # not relaunched: a setting shard-train refuses (exit 2), and a run the user stops (Ctrl-C)
    # (Ctrl-C: the run ends by its own exit, 130, or by the TERM local.sh passes on, 143)
    for stop, statuses, said in (("exit 2", (2,), "refused its settings (exit 2); not restarting"),
                                 ("kill -INT $PPID; exit 130", (130, 143), "stopped by a signal (exit 1")):
        calls.write_text("0")
        fake.write_text(f'#!/bin/bash\n[[ $1 == --version ]] && {{ echo "fake MPI"; exit 0; }}\n'
                        f'echo $(( $(cat {calls}) + 1 )) > {calls}\n{stop}\n')
        for _ in range(5):   # the race between the run's exit and the TERM, both ways
            proc = run("local.sh", dry=False, MPIEXEC=str(fake), RESTARTS="3")
            assert proc.returncode in statuses and said in proc.stderr, (proc.returncode, proc.stderr)
            assert "not restarting" in proc.stderr and "restart 1" not in proc.stderr
        assert int(calls.read_text()) == 5


def test_a_term_stops_a_restarting_run_at_once(tmp_path):
    """With RESTARTS > 0 a TERM to local.sh (a scheduler's at the time limit) waited for the
    whole run to end: bash runs a trap only once the foreground command is done. It is now
    passed on to the run, and nothing is relaunched."""
    calls, fake = tmp_path / "calls", tmp_path / "mpiexec"
    calls.write_text("0")
    fake.write_text(f'#!/bin/bash\n[[ $1 == --version ]] && {{ echo "fake MPI"; exit 0; }}\n'
                    f'echo $(( $(cat {calls}) + 1 )) > {calls}\ntrap "exit 143" TERM\n'
                    f'for i in $(seq 300); do sleep 0.1; done\n')
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(SCRUB)}
    proc = subprocess.Popen(["bash", str(LAUNCH / "local.sh"), "train.out_dir=runs/term"], cwd=ROOT, text=True,
                            env={**base, "PYTHON": sys.executable, "MPIEXEC": str(fake), "RESTARTS": "2"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 20
    while calls.read_text().strip() != "1" and time.monotonic() < deadline:
        time.sleep(0.1)
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    assert time.monotonic() - started < 5 and proc.returncode == 143, (proc.returncode, err)
    assert "stopped by a signal (exit 143); not restarting" in err and calls.read_text().strip() == "1"


def test_a_torchrun_that_is_not_there_is_named():
    fail(run("torchrun.sh", TORCHRUN="/nonexistent", NPROC_PER_NODE="2"), "TORCHRUN '/nonexistent' not found")
