"""The collectives pccl implements, by the names every layer uses."""

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
