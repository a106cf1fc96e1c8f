"""Partitioning: per-parameter costs, buffer layout, DP cuts, TP micro-groups, baselines."""
