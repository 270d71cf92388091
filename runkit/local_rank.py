"""This process's rank among the ranks of its node, from what its launcher set: the GPU it
takes (local rank modulo the node's GPUs)."""
import os

# The launchers' own first, Slurm's last: mpiexec inside a Slurm job starts its per-node
# daemons with srun, so every rank it launches inherits the daemon's SLURM_LOCALID, 0. The
# variable of the launcher that started the ranks is right; Slurm's is, only under srun.
LOCAL_RANK_VARS = ("LOCAL_RANK",                    # torchrun
                   "OMPI_COMM_WORLD_LOCAL_RANK",    # Open MPI
                   "MPI_LOCALRANKID",               # MPICH's Hydra
                   "PALS_LOCAL_RANKID",             # Cray PALS (aprun, mpiexec on HPE systems)
                   "PMI_LOCAL_RANK",                # PMI-based launchers
                   "SLURM_LOCALID")                 # srun


def local_rank(env=os.environ) -> int:
    """The first of LOCAL_RANK_VARS the launcher set, else 0 (one rank)."""
    return next((int(env[v]) for v in LOCAL_RANK_VARS if env.get(v, "").strip()), 0)
