"""Helpers that pccl and shard both use and that are not about collectives: crash-safe
file writes, byte sizes as people write them, command-line argument checks, and the
mpiexec launcher. It imports neither package."""
