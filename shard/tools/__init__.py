"""The command-line tools (shard-train, shard-compare, shard-bench, shard-plan, shard-sim,
the checkpoint benchmark and the convergence check) and the helpers only they use (the run
log, fault injection, preflight checks, the learning-rate schedule). Tools import planning,
the engine, the data and the models; no library module imports a tool, and no tool imports
another tool's command module."""
