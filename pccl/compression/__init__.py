"""Collective-level compression: codecs (codecs.py) and how schedules move encoded blocks
(pccl/ir/compressed.py)."""
