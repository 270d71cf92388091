"""Reading built schedules and plans: the symbolic verifier and per-peer traffic."""
