#!/usr/bin/env bash
# Train with torchrun on NVIDIA (or ROCm) nodes: torch.distributed transport (comm=torch,
# NCCL/RCCL), NPROC_PER_NODE ranks per node, c10d rendezvous at MASTER_ADDR:MASTER_PORT.
# Run it once per node: torchrun starts the node's ranks.
#
#   NPROC_PER_NODE=8 launch/torchrun.sh model=gpt_125m train.steps=100          # one node
#   NNODES=2 MASTER_ADDR=node0 launch/torchrun.sh ...                           # on each node
#   srun -N 4 --ntasks-per-node=1 launch/torchrun.sh ...                        # under Slurm
#   DRY_RUN=1 NPROC_PER_NODE=4 launch/torchrun.sh    # print the command instead of running it
#
# Parameters (environment variables; an empty MODEL/STRATEGY/COMM leaves that override out,
# and so does an override of the same key among the arguments):
#   NNODES          nodes (default: the Slurm step's, SLURM_STEP_NUM_NODES or SLURM_NNODES, else 1)
#   NPROC_PER_NODE  ranks per node (default SLURM_GPUS_ON_NODE, else the GPUs nvidia-smi lists)
#   MASTER_ADDR     rendezvous host (default: the first host of the Slurm step's nodes,
#                   SLURM_STEP_NODELIST, else SLURM_NODELIST, else SLURM_JOB_NODELIST: a step
#                   on part of the job's nodes meets on one of its own; else 127.0.0.1 on one
#                   node; required for several nodes outside Slurm)
#   MASTER_PORT     rendezvous port (default 29500)
#   RDZV_ID         rendezvous id, the same on every node (default SLURM_JOB_ID, with
#                   .SLURM_STEP_ID in a step, so two steps of a job meet apart; else shard-train)
#   MODEL           model preset (default gpt_125m)
#   STRATEGY        sharding strategy (default zero3)
#   COMM            communicator (default torch)
#   DEVICE          cuda or cpu -> train.device (default cuda)
#   PYTHON          interpreter (default: the repository's .venv/bin/python, else python3)
#   TORCHRUN        torchrun command, split on spaces (default: the torchrun next to PYTHON,
#                   else "PYTHON -m torch.distributed.run")
#   TORCHRUN_ARGS   extra torchrun arguments, split on spaces (default none)
#   RESTARTS        torchrun --max-restarts: after a rank fails, restart every rank up to this
#                   many times, each with train.resume=auto in one train.out_dir (default
#                   runs/slurm-<job id> under Slurm, a new runs/<date> on one node; give
#                   train.out_dir for several nodes outside Slurm) (default 0). Under Slurm a
#                   run resumes in any case, as the sbatch scripts' do: train.out_dir defaults
#                   to runs/slurm-<job id> and train.resume to auto
#   DRY_RUN         1: print the command line, run nothing (default 0)
set -euo pipefail

NAME=torchrun.sh
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=SCRIPTDIR/common.sh
source "$ROOT/launch/common.sh"

NNODES=${NNODES:-${SLURM_STEP_NUM_NODES:-${SLURM_NNODES:-${SLURM_JOB_NUM_NODES:-1}}}}
NODELIST=${SLURM_STEP_NODELIST:-${SLURM_NODELIST:-${SLURM_JOB_NODELIST:-}}}
MASTER_PORT=${MASTER_PORT:-29500}
RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-shard-train}${SLURM_STEP_ID:+.$SLURM_STEP_ID}}
MODEL=${MODEL-gpt_125m}
STRATEGY=${STRATEGY-zero3}
COMM=${COMM-torch}
DEVICE=${DEVICE-cuda}
TORCHRUN_ARGS=${TORCHRUN_ARGS:-}
default_python "$ROOT"

is_posint "$NNODES" || die "NNODES must be a positive integer, got '$NNODES'"
if [[ -z ${NPROC_PER_NODE:-} ]]; then
    if [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
        NPROC_PER_NODE=$SLURM_GPUS_ON_NODE
    elif command -v nvidia-smi >/dev/null 2>&1; then
        NPROC_PER_NODE=$(nvidia-smi -L | grep -c '^GPU' || true)
    fi
    [[ -n ${NPROC_PER_NODE:-} && ${NPROC_PER_NODE:-0} != 0 ]] ||
        die "cannot tell how many GPUs this node has; set NPROC_PER_NODE"
fi
is_posint "$NPROC_PER_NODE" || die "NPROC_PER_NODE must be a positive integer, got '$NPROC_PER_NODE'"
{ is_posint "$MASTER_PORT" && (( MASTER_PORT < 65536 )); } || die "MASTER_PORT must be a port number, got '$MASTER_PORT'"
[[ -z $DEVICE || $DEVICE == cpu || $DEVICE == cuda ]] || die "DEVICE must be cuda or cpu, got '$DEVICE'"
if [[ -z ${MASTER_ADDR:-} ]]; then
    if [[ -n $NODELIST ]]; then
        command -v scontrol >/dev/null 2>&1 || die "scontrol not found to read the Slurm node list; set MASTER_ADDR"
        hosts=$(scontrol show hostnames "$NODELIST") ||
            die "scontrol show hostnames '$NODELIST' failed; set MASTER_ADDR"
        MASTER_ADDR=${hosts%%$'\n'*}
        [[ -n $MASTER_ADDR ]] || die "no host in the Slurm node list '$NODELIST'; set MASTER_ADDR"
    elif (( NNODES == 1 )); then
        MASTER_ADDR=127.0.0.1
    else
        die "NNODES=$NNODES outside Slurm: set MASTER_ADDR to the first node's address (the same on every node)"
    fi
fi

if [[ -n ${TORCHRUN:-} ]]; then
    read -r -a torchrun <<< "$TORCHRUN"
    command -v "${torchrun[0]}" > /dev/null || die "TORCHRUN '${torchrun[0]}' not found"
else
    PYTHON_PATH=$(command -v "$PYTHON") || die "PYTHON '$PYTHON' not found"
    if [[ -x $(dirname "$PYTHON_PATH")/torchrun ]]; then
        torchrun=("$(dirname "$PYTHON_PATH")/torchrun")
    else
        torchrun=("$PYTHON" -m torch.distributed.run)
    fi
fi
read -r -a extra <<< "$TORCHRUN_ARGS"

trainer_overrides "$NPROC_PER_NODE" "$DEVICE" "$@"
if [[ -n ${SLURM_JOB_ID:-} ]]; then
    slurm_overrides "$@"   # runs/slurm-<job id> and train.resume=auto: a requeued job resumes, as the sbatch scripts'
elif (( NNODES == 1 )); then
    restart_overrides "runs/$(date -u +%Y-%m-%d_%H-%M-%S)" "$@"
else
    restart_overrides "" "$@"   # each node would pick its own
fi
(( RESTARTS == 0 )) || extra+=(--max-restarts="$RESTARTS")

cmd=("${torchrun[@]}" --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" --rdzv-backend=c10d
     --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$RDZV_ID" "${extra[@]}"
     -m shard.tools.train "${overrides[@]}" "$@")

if [[ $DRY_RUN == 1 ]]; then
    quote_words "${cmd[@]}"
    exit 0
fi
exec "${cmd[@]}"
