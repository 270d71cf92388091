"""Helpers that pccl and shard both use and that are not about collectives: crash-safe
file writes, byte sizes as people write them, command-line argument checks, the mpiexec
launcher, the CPUs a process may use and its local rank. It imports neither package."""
