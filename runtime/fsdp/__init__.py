"""FSDP2 models: `FsdpOptimizer` executes an FSDP schedule; `checks` tells FSDP2 apart for
`CanzonaOptimizer`."""
