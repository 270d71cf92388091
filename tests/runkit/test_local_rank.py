"""A rank's local rank, from its launcher's variables, as each launcher sets them."""
from runkit.local_rank import local_rank


def test_mpiexec_inside_a_slurm_job_takes_mpis_local_rank_not_the_daemons_slurm_localid():
    """Hydra and Open MPI start their per-node daemons with srun: each rank inherits
    SLURM_LOCALID=0 from its daemon, and only the MPI launcher's variable tells them apart."""
    slurm = {"SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_JOB_ID": "7"}
    assert [local_rank({**slurm, "MPI_LOCALRANKID": str(r)}) for r in range(4)] == [0, 1, 2, 3]
    assert [local_rank({**slurm, "OMPI_COMM_WORLD_LOCAL_RANK": str(r)}) for r in range(4)] == [0, 1, 2, 3]
    assert local_rank({**slurm, "PALS_LOCAL_RANKID": "5", "PMI_LOCAL_RANK": "5"}) == 5   # Cray PALS


def test_srun_torchrun_and_a_lone_process():
    assert local_rank({"SLURM_LOCALID": "3", "SLURM_PROCID": "11"}) == 3                 # srun
    assert local_rank({"LOCAL_RANK": "2", "SLURM_LOCALID": "0"}) == 2                     # torchrun under Slurm
    assert local_rank({}) == 0
    assert local_rank({"MPI_LOCALRANKID": "", "SLURM_LOCALID": "1"}) == 1                 # set but empty: not set
