"""The algorithm data model: schedules (one rank's steps of block transfers), plans (phases
on the node levels plus local steps) and the block layout. Builders live in
pccl.algorithms and pccl.plans; executors, the verifier and the cost model read these objects."""
