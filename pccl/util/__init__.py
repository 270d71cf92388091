"""Helpers with no pccl dependencies: crash-safe file writes, byte sizes as people write
them, and the mpiexec launcher."""
