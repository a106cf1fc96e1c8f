"""The α–β model of one collective, on the busiest rank of its group (links are full duplex):

    seconds = steps · α + max over ranks of max(bytes sent, bytes received) / bandwidth

with steps = n − 1 for reduce-scatter, all-gather and all-to-all (ring / pairwise exchange),
2(n − 1) for a ring all-reduce (each rank moves 2(n − 1)/n of the buffer), ⌈log2 n⌉ for a
pipelined broadcast (each rank moves the buffer once), and 1 for a point-to-point round.

A bucket's uneven reduce-scatter (all-gather) comes in two forms, as the runtime offers them:

- `rooted` (the default): one reduce to (broadcast from) each non-empty slice's owner, issued
  together. Each is a pipelined tree, so every link carries the bucket about once whatever the
  cuts; each pays ⌈log2 n⌉ α.
- `all_to_all`: one `all_to_all_single` with split sizes. Rank r receives (n − 1)·slice_r, so a
  bucket landing on one rank costs that rank's link the whole bucket n − 1 times.

A bucket whose slices are all equal (AdamW; stock ZeRO cuts) is a native ring reduce-scatter
(all-gather) either way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

GRAD_BYTES = 4  # fp32 gradients and updates on the wire
STEP_FACTORS = {"reduce-scatter": 1, "all-gather": 1, "all-to-all": 1, "all-reduce": 2}


@dataclass(frozen=True)
class Link:
    """The network of one process group: its size, per-rank bandwidth and α."""

    name: str
    size: int
    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Exchange:
    """One collective: its kind and the bytes every rank of the group sends and receives."""

    kind: str
    link: Link
    sent: tuple[float, ...]
    received: tuple[float, ...]
    latency_steps: int | None = None

    def steps(self) -> int:
        """How many α the collective pays."""
        n = self.link.size
        if self.latency_steps is not None:
            return self.latency_steps
        if self.kind == "broadcast":
            return math.ceil(math.log2(n))
        return 1 if self.kind == "p2p" else STEP_FACTORS[self.kind] * (n - 1)

    def seconds(self) -> float:
        """α–β time of the collective on its busiest rank (0 for a group of one or no bytes)."""
        volume = max(max(self.sent, default=0.0), max(self.received, default=0.0))
        if self.link.size <= 1 or volume <= 0:
            return 0.0
        return self.steps() * self.link.latency + volume / self.link.bandwidth


def reduce_scatter(link: Link, slices: Sequence[int], elem_bytes: int) -> Exchange:
    """Uneven reduce-scatter as one all-to-all: rank r gets slice r summed over the group."""
    total, n = sum(slices), link.size
    return Exchange("reduce-scatter", link, tuple(float((total - s) * elem_bytes) for s in slices),
                    tuple(float((n - 1) * s * elem_bytes) for s in slices))


def all_gather(link: Link, slices: Sequence[int], elem_bytes: int) -> Exchange:
    """Uneven all-gather as one all-to-all: every rank gets every slice."""
    total, n = sum(slices), link.size
    return Exchange("all-gather", link, tuple(float((n - 1) * s * elem_bytes) for s in slices),
                    tuple(float((total - s) * elem_bytes) for s in slices))


def all_reduce(link: Link, numel: int, elem_bytes: int) -> Exchange:
    """Ring all-reduce of `numel` elements: every rank moves 2(n − 1)/n of the buffer each way."""
    n = link.size
    volume = 2 * (n - 1) * numel * elem_bytes / n if n > 1 else 0.0
    return Exchange("all-reduce", link, (volume,), (volume,))  # every rank alike: one entry


def broadcast(link: Link, nbytes: float) -> Exchange:
    """Pipelined broadcast of `nbytes` from one rank: every rank moves them once."""
    return Exchange("broadcast", link, (nbytes,), (nbytes,))  # every rank alike: one entry


def rooted(link: Link, slices: Sequence[int], elem_bytes: int) -> Exchange:
    """An uneven reduce-scatter (all-gather) done as one pipelined tree reduce (broadcast)
    per non-empty slice, rooted at its owner: every link carries the bucket once, whatever
    the cuts, for ⌈log2 n⌉ α per slice."""
    n, volume = link.size, float(sum(slices) * elem_bytes)
    steps = sum(1 for s in slices if s) * math.ceil(math.log2(n)) if n > 1 else 0
    return Exchange("rooted", link, (volume,), (volume,), steps)


def uneven(link: Link, slices: Sequence[int], elem_bytes: int, gather: bool, use_rooted: bool) -> Exchange:
    """A bucket's reduce-scatter (gather=False) or all-gather at the given slices, as the
    runtime issues it: rooted when asked and the slices differ, else one all-to-all (which
    for equal slices is what a native ring collective moves)."""
    if use_rooted and len(set(slices)) > 1:
        return rooted(link, slices, elem_bytes)
    return all_gather(link, slices, elem_bytes) if gather else reduce_scatter(link, slices, elem_bytes)


def phase_seconds(exchanges: Sequence[Exchange], fused: bool = False) -> float:
    """Seconds of collectives run one after another. `fused`: collectives of the same kind on
    the same group become one (per-rank bytes summed, α paid once), as a runtime that moves a
    whole buffer in one exchange does; broadcasts (different roots) never fuse."""
    if not fused:
        return sum(exchange.seconds() for exchange in exchanges)
    merged: dict[tuple[str, Link], Exchange] = {}
    rest: list[Exchange] = []
    for ex in exchanges:
        key = (ex.kind, ex.link)
        if ex.kind == "broadcast":
            rest.append(ex)
        elif key in merged:
            old = merged[key]
            merged[key] = Exchange(ex.kind, ex.link, tuple(a + b for a, b in zip(old.sent, ex.sent)),
                                   tuple(a + b for a, b in zip(old.received, ex.received)),
                                   max(old.steps(), ex.steps()))
        else:
            merged[key] = ex
    return sum(ex.seconds() for ex in (*merged.values(), *rest))
