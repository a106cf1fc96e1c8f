"""The optimizer state in logical form (independent of the schedule) and its checkpoints."""
