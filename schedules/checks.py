"""What the validator's rules share: the first problem found, raised as `Problem` and turned
into the one line `validate.schedule_problem` returns, and the float tolerance of recomputed
figures."""

from __future__ import annotations

import math

# Recomputed sums differ from the planner's only by summation order: about n · 2^-53 relative
# for n ≤ 65536 terms (< 1e-11), so 1e-9 relative flags any edit while never a planner file.
REL_TOL = 1e-9
ABS_TOL = 1e-12


class Problem(Exception):
    """The first inconsistency found (its message is the validator's one line)."""


def fail(message: str) -> None:
    """Stop validating: `message` is the file's first problem."""
    raise Problem(message)


def close(a: float, b: float) -> bool:
    """Whether a recorded float agrees with its recomputation."""
    return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def expect(label: str, recorded: float, derived: float, what: str) -> None:
    """Fail unless the recorded `label` agrees with the value `what` gives."""
    if not close(recorded, derived):
        fail(f"{label} is {recorded!r}, but {what} gives {derived!r}")
