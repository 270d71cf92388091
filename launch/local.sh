#!/usr/bin/env bash
# Train on one machine: NPROC ranks started by mpiexec, optionally grouped into emulated
# nodes of RANKS_PER_NODE consecutive ranks (so hierarchical plans run here too).
#
#   launch/local.sh [hydra overrides...]
#   NPROC=8 RANKS_PER_NODE=4 MODEL=tiny STRATEGY=zero3 launch/local.sh train.steps=20
#   DRY_RUN=1 NPROC=4 launch/local.sh      # print the command instead of running it
#
# Parameters (environment variables; an empty MODEL/STRATEGY/COMM/DEVICE leaves that
# override out, and so does an override of the same key among the arguments):
#   NPROC           number of ranks (default 2)
#   RANKS_PER_NODE  ranks per emulated node -> comm.ranks_per_node (default: unset, one node)
#   MODEL           model preset (default tiny)
#   STRATEGY        sharding strategy (default zero3)
#   COMM            communicator: pccl, native, hierarchical, torch (default pccl)
#   DEVICE          auto, cpu or cuda -> train.device (default auto: cuda when torch sees a GPU)
#   PYTHON          interpreter (default: the repository's .venv/bin/python, else python3)
#   MPIEXEC         mpiexec (default: the one next to PYTHON, else mpiexec on PATH)
#   MPIEXEC_ARGS    extra mpiexec arguments, split on spaces (default none)
#   OMP_NUM_THREADS threads per rank (default 1 on cpu with several ranks; one rank: shard-train
#                   takes every core it may use)
#   RESTARTS        relaunch a failed run up to this many times, each with train.resume=auto
#                   (the newest intact checkpoint); train.out_dir is fixed for all attempts
#                   (default 0: no relaunch)
#   DRY_RUN         1: print the environment and the command line, run nothing (default 0)
set -euo pipefail

NAME=local.sh
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=SCRIPTDIR/common.sh
source "$ROOT/launch/common.sh"

NPROC=${NPROC:-2}
RANKS_PER_NODE=${RANKS_PER_NODE:-}
MODEL=${MODEL-tiny}
STRATEGY=${STRATEGY-zero3}
COMM=${COMM-pccl}
DEVICE=${DEVICE-auto}
MPIEXEC_ARGS=${MPIEXEC_ARGS:-}
default_python "$ROOT"

is_posint "$NPROC" || die "NPROC must be a positive integer, got '$NPROC'"
if [[ -n $RANKS_PER_NODE ]]; then
    is_posint "$RANKS_PER_NODE" || die "RANKS_PER_NODE must be a positive integer, got '$RANKS_PER_NODE'"
    (( NPROC % RANKS_PER_NODE == 0 )) ||
        die "NPROC ($NPROC) must be divisible by RANKS_PER_NODE ($RANKS_PER_NODE)"
fi
[[ -z $DEVICE || $DEVICE == auto || $DEVICE == cpu || $DEVICE == cuda ]] || die "DEVICE must be auto, cpu or cuda, got '$DEVICE'"
PYTHON_PATH=$(command -v "$PYTHON") || die "PYTHON '$PYTHON' not found"

# The mpiexec next to the interpreter, with what Open MPI needs to run as root and with
# more ranks than cores (as runkit.mpirun.launcher(); MPICH needs nothing).
if [[ -z ${MPIEXEC:-} ]]; then
    if [[ -x $(dirname "$PYTHON_PATH")/mpiexec ]]; then
        MPIEXEC=$(dirname "$PYTHON_PATH")/mpiexec
    else
        MPIEXEC=$(command -v mpiexec) || die "no mpiexec next to $PYTHON_PATH or on PATH; set MPIEXEC"
    fi
fi
command -v "$MPIEXEC" >/dev/null || die "MPIEXEC '$MPIEXEC' not found"
launcher=("$MPIEXEC")
if "$MPIEXEC" --version 2>/dev/null | grep -qE 'Open MPI|OpenRTE'; then
    launcher+=(--allow-run-as-root --oversubscribe --mca mpi_yield_when_idle 1)
fi
read -r -a extra <<< "$MPIEXEC_ARGS"

trainer_overrides "$RANKS_PER_NODE" "$DEVICE" "$@"
restart_overrides "runs/$(date -u +%Y-%m-%d_%H-%M-%S)" "$@"

cmd=("${launcher[@]}" "${extra[@]}" -n "$NPROC" "$PYTHON" -m shard.tools.train "${overrides[@]}" "$@")

if [[ ($DEVICE != cuda && $NPROC -gt 1) || -n ${OMP_NUM_THREADS:-} ]]; then
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    [[ $DRY_RUN == 1 ]] && echo "export OMP_NUM_THREADS=$(quote_words "$OMP_NUM_THREADS")"
fi
if [[ $DRY_RUN == 1 ]]; then
    quote_words "${cmd[@]}"
    exit 0
fi
run_restarting
