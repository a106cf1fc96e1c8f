"""Adapters for the training stacks canzona runs inside: what each stack's models say about their
parameters (read by `canzona.runtime.tools.describe`), and the few functions a training loop of
that stack needs around `CanzonaOptimizer`. None of them imports its stack: they read the
attributes and configs the stack puts on its modules."""
