"""Executors: one per transport, each runs any schedule from pccl.algorithms."""
