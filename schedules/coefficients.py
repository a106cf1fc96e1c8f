"""Newton–Schulz coefficient schedules: the (a, b, c) of each iteration of Muon's
orthogonalisation X ← a·X + b·(X·Xᵀ)·X + c·(X·Xᵀ)²·X, by name.

A schedule is part of the optimizer settings a schedule file records (`request.optimizer.
ns_coefficients`), so it changes the file's digest; the planner validates the name and the
runtime executes the iterations it names. The numbers are the published ones, as Megatron-core
(through NVIDIA's Emerging-Optimizers) runs them:

- `simple`: one triple for every iteration (Keller Jordan's Muon; canzona's default).
- `quintic`: five triples, one per iteration, tuned for a five-step quintic iteration
  (Megatron-core's default). Past the fifth iteration the list starts again.
- `polar_express`: the Polar Express schedule (Amsel et al., 2025), eight triples with its
  1.01 safety factor folded in. Past the eighth iteration the last triple repeats.
"""

from __future__ import annotations

Coefficients = tuple[float, float, float]

NS_COEFFICIENT_SCHEDULES: dict[str, tuple[Coefficients, ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
}
NS_COEFFICIENT_NAMES = tuple(NS_COEFFICIENT_SCHEDULES)
DEFAULT_NS_COEFFICIENTS = "simple"
_CYCLING = frozenset({"quintic"})  # the others repeat their last triple past their end


def coefficient_steps(name: str, steps: int) -> tuple[Coefficients, ...]:
    """The (a, b, c) of each of `steps` iterations under the named schedule (KeyError for a
    name that is not one)."""
    table = NS_COEFFICIENT_SCHEDULES[name]
    if name in _CYCLING:
        return tuple(table[i % len(table)] for i in range(steps))
    return tuple(table[min(i, len(table) - 1)] for i in range(steps))
