"""Executors: one per transport, each runs any schedule from pccl.algorithms; the plan
executor runs two-level plans over per-level communicators, with the GPU shuffle kernel."""
