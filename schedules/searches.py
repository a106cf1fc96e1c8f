"""The automatic searches a schedule may record (`--alpha auto`, `--bucket-size auto`): the
candidates they try and the rules that pick the winner. One definition that the planner
searches by and the schedule validator re-checks a file's `alpha_search` and `bucket_search`
with: the candidates must be these, the chosen value the one the rule picks from the recorded
predictions, and (bucket sizes) each trial's bucket count the geometry's. The predicted times
themselves are the simulator's, which only re-planning reproduces.
"""

from __future__ import annotations

from collections.abc import Sequence

DEFAULT_ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
ONE_BUCKET = 1 << 40  # larger than any buffer: one bucket per buffer
DEFAULT_BUCKET_SIZES = (10_000_000, 20_000_000, 40_000_000, 100_000_000, 200_000_000, 400_000_000, ONE_BUCKET)
TIE_TOLERANCE = 1e-9  # relative: predicted times this close count as equal


def size_label(size: int) -> str:
    """A bucket size as people write it (40M, or 'one bucket')."""
    if size >= ONE_BUCKET:
        return "one bucket"
    return f"{size / 1e6:g}M" if size % 1_000_000 == 0 else str(size)


def alpha_winner(times: Sequence[float]) -> int:
    """The position of the winning α among candidates in ascending order, given each one's
    predicted time: the fastest, ties (within TIE_TOLERANCE) going to the larger α."""
    best: float | None = None
    chosen = 0
    for position, seconds in enumerate(times):
        if best is None or seconds <= best * (1 + TIE_TOLERANCE):
            best, chosen = (seconds if best is None else min(seconds, best)), position
    return chosen


def bucket_winner(sizes: Sequence[int], counts: Sequence[int], times: Sequence[float]) -> tuple[int, str]:
    """The position of the winning bucket size and why, in one line: among the sizes that keep
    at least two matrix buckets (every size, if none does), the fastest predicted iteration,
    exact ties going to the smaller size."""
    positions = range(len(sizes))
    overlapping = [p for p in positions if counts[p] >= 2]
    pool = overlapping or list(positions)
    fastest = min(times[p] for p in pool)
    chosen = min((p for p in pool if times[p] <= fastest * (1 + TIE_TOLERANCE)), key=lambda p: sizes[p])
    scope = (
        "sizes that keep >= 2 matrix buckets to overlap with backward"
        if overlapping
        else "every size (none keeps 2 matrix buckets)"
    )
    return chosen, (
        f"{size_label(sizes[chosen])} ({counts[chosen]} matrix buckets): the fastest predicted "
        f"iteration, {times[chosen] * 1e3:.3f} ms, among {scope}"
    )
