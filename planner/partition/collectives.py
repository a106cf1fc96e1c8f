"""The α–β model of one collective, on the busiest rank of its group (links are full duplex):

    seconds = steps · α + max over ranks of max(bytes sent, bytes received) / bandwidth

with steps = n − 1 for reduce-scatter, all-gather and all-to-all (ring / pairwise exchange),
2(n − 1) for a ring all-reduce (each rank moves 2(n − 1)/n of the buffer), ⌈log2 n⌉ for a
pipelined broadcast (each rank moves the buffer once), and 1 for a point-to-point round.

A bucket of a matrix buffer is reduced (and gathered) over its DP group in one of three forms
(`BUCKET_COLLECTIVES`), as the runtime issues them:

- `ring`: a native ring reduce-scatter (all-gather) over slices padded to the largest, m: every
  rank moves (n − 1)·m, in n − 1 steps (Megatron's layer-wise optimizer pads the same way);
- `rooted`: one pipelined reduce to (broadcast from) each non-empty slice's owner, issued
  together. Each is a chain through the group, so a rank sends every slice but its own and
  receives every slice but one: the busiest rank moves the bucket less its smallest slice,
  and each reduce pays ⌈log2 n⌉ α. Where every slice is equal the runtime issues the native
  ring instead, and it is priced as one;
- `all_to_all`: one `all_to_all_single` with split sizes: rank r receives (n − 1)·slice_r and
  sends the rest of the bucket, in n − 1 steps;
- `reslice`: a native ring reduce-scatter over equal slices (stock ZeRO-1, w = bucket / n),
  then one all-to-all moving each element of a rank's equal slice to the owner whose slice holds
  it (`reslice_moves`); the gather runs it backwards. Every rank moves (n − 1)·w plus its own
  spill-over; the all-to-all is one point-to-point round (one α, as the start-owner baseline's
  spill-over fetch: the same traffic, priced the same way), none when no element moves.

All four are continuous in the slice sizes (for equal slices the ring and the rooted chains
move the same bytes), so their minimum is too: `choose_collective` prices each for both
directions (fp32 gradients in, parameters out) and keeps the cheapest. The planner chooses on
`REFERENCE_NETWORK` (H100 nodes); the simulator prices the recorded choice on any network.
`NS_BF16_FLOPS` is the same reference device's matrix throughput.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from canzona.schedules.geometry import reslice_moves
from canzona.schedules.limits import BUCKET_COLLECTIVES

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
class Network:
    """A cluster's network: α per collective step, per-device bandwidth inside a node and
    across nodes (bytes/s per direction), and devices per node."""

    latency: float
    intra_bandwidth: float
    inter_bandwidth: float
    gpus_per_node: int


REFERENCE_NETWORK = Network(latency=5e-6, intra_bandwidth=450e9, inter_bandwidth=50e9, gpus_per_node=8)
"""H100 SXM nodes: NVLink 4 inside a node, InfiniBand NDR across (the `h100` hardware model of
`canzona.planner.predict.hardware`, whose sources it cites): the network the planner chooses each
bucket's collective on."""

NS_BF16_FLOPS = 575e12
"""The reference device's matrix throughput, the runtime's default Newton-Schulz on CUDA (bf16
operands, fp32 accumulation, the fused `baddbmm` form) measured on one H200: 575 TFLOP/s over
qwen3-1.7b's matrices one at a time (586 stacked by shape). The `h100` and `h200` hardware models
run at it, and cooperative hosting turns seconds of communication into FLOPs at it."""

FP32_SHARE = 48e12 / NS_BF16_FLOPS
"""The reference device's fp32 matrix rate relative to its bf16 one: Newton–Schulz with
`ns_dtype="fp32"` measured 48 TFLOP/s on the same H200 (CUDA cores: 72% of the datasheet's 67
TFLOP/s FP32)."""
TF32_SHARE = 0.58 * 494.7e12 / NS_BF16_FLOPS
"""The reference device's TF32 matrix rate relative to its bf16 one: not measured (no GPU since
TF32 was added); the bf16 kernel's measured share of its peak (58%) of the datasheet's 494.7
TFLOP/s dense TF32, an assumption."""
PRECISION_SHARES = {"bf16": 1.0, "tf32": TF32_SHARE, "fp32": FP32_SHARE}


def reference_rate(precision: str) -> float:
    """The reference device's matrix FLOP/s in `precision` (bf16, tf32, fp32)."""
    return NS_BF16_FLOPS * PRECISION_SHARES[precision]


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


def group_link(network: Network, name: str, ranks: Sequence[int]) -> Link:
    """A process group's link (`ranks`: global ranks): inter-node bandwidth if they span nodes."""
    nodes = {rank // network.gpus_per_node for rank in ranks}
    bandwidth = network.inter_bandwidth if len(nodes) > 1 else network.intra_bandwidth
    return Link(name, len(ranks), bandwidth, network.latency)


def layout_links(network: Network, tp: int, dp: int, ep: int) -> tuple[Link, Link, Link]:
    """The DP, expert-DP and TP links of a layout (global rank = dp_rank · tp + tp_rank): of
    each kind of group, the slowest decides."""

    def worst(name: str, groups: list[list[int]]) -> Link:
        return min((group_link(network, name, g) for g in groups), key=lambda link: link.bandwidth)

    dp_groups = [[r * tp + t for r in range(dp)] for t in {0, tp - 1}]
    expert_groups = [[(o * ep + e) * tp + t for o in range(dp // ep)] for t in {0, tp - 1} for e in {0, ep - 1}]
    tp_groups = [[r * tp + t for t in range(tp)] for r in range(dp)]
    return worst("dp", dp_groups), worst("expert-dp", expert_groups), worst("tp", tp_groups)


def reduce_scatter(link: Link, slices: Sequence[int], elem_bytes: int) -> Exchange:
    """Uneven reduce-scatter as one all-to-all: rank r gets slice r summed over the group."""
    total, n = sum(slices), link.size
    return Exchange(
        "reduce-scatter",
        link,
        tuple([float((total - s) * elem_bytes) for s in slices]),
        tuple([float((n - 1) * s * elem_bytes) for s in slices]),
    )


def all_gather(link: Link, slices: Sequence[int], elem_bytes: int) -> Exchange:
    """Uneven all-gather as one all-to-all: every rank gets every slice."""
    total, n = sum(slices), link.size
    return Exchange(
        "all-gather",
        link,
        tuple([float((n - 1) * s * elem_bytes) for s in slices]),
        tuple([float((total - s) * elem_bytes) for s in slices]),
    )


def padded_ring(link: Link, slices: Sequence[int], elem_bytes: int) -> Exchange:
    """A native ring reduce-scatter (all-gather) over every slice padded to the largest: each
    rank sends and receives n − 1 padded slices."""
    volume = float((link.size - 1) * max(slices, default=0) * elem_bytes)
    return Exchange("reduce-scatter", link, (volume,) * len(slices), (volume,) * len(slices))


def all_reduce(link: Link, numel: int, elem_bytes: int) -> Exchange:
    """Ring all-reduce of `numel` elements: every rank moves 2(n − 1)/n of the buffer each way."""
    n = link.size
    volume = 2 * (n - 1) * numel * elem_bytes / n if n > 1 else 0.0
    return Exchange("all-reduce", link, (volume,), (volume,))  # every rank alike: one entry


def broadcast(link: Link, nbytes: float) -> Exchange:
    """Pipelined broadcast of `nbytes` from one rank: every rank moves them once."""
    return Exchange("broadcast", link, (nbytes,), (nbytes,))  # every rank alike: one entry


def rooted(link: Link, slices: Sequence[int], elem_bytes: int) -> Exchange:
    """An uneven reduce-scatter (all-gather) done as one pipelined chain reduce (broadcast) per
    non-empty slice, rooted at its owner, the chain starting at the next rank: rank r sends
    every slice but its own and receives every slice but its predecessor's; ⌈log2 n⌉ α per
    slice."""
    n, total = link.size, sum(slices)
    steps = (len(slices) - list(slices).count(0)) * math.ceil(math.log2(n)) if n > 1 else 0
    sent = tuple([float((total - s) * elem_bytes) for s in slices])
    received = sent[-1:] + sent[:-1]  # every slice but its predecessor's
    return Exchange("rooted", link, sent, received, steps)


def resliced(link: Link, slices: Sequence[int], elem_bytes: int, gather: bool) -> Exchange:
    """A native ring reduce-scatter over equal slices, then one point-to-point round moving each
    element to the owner whose slice holds it (`gather`: the round back, then the ring
    all-gather): n − 1 equal slices plus the rank's spill-over each way."""
    n, moves = link.size, reslice_moves(slices)
    ring = float((n - 1) * -(-sum(slices) // n) * elem_bytes)
    out = [ring + moved * elem_bytes for moved, _ in moves]
    back = [ring + moved * elem_bytes for _, moved in moves]
    steps = n - 1 + (1 if any(sent or received for sent, received in moves) else 0)
    return Exchange("reslice", link, tuple(back if gather else out), tuple(out if gather else back), steps)


def bucket_exchange(link: Link, slices: Sequence[int], elem_bytes: int, gather: bool, collective: str) -> Exchange:
    """One bucket's reduce-scatter (gather=False) or all-gather at the given slices, in the
    form `collective` (`BUCKET_COLLECTIVES`), as the runtime issues it: equal slices are a
    native ring whatever the form but `all_to_all`."""
    if collective not in BUCKET_COLLECTIVES:
        raise ValueError(f"unknown bucket collective {collective!r}; one of {', '.join(BUCKET_COLLECTIVES)}")
    if collective == "all_to_all":
        return all_gather(link, slices, elem_bytes) if gather else reduce_scatter(link, slices, elem_bytes)
    if collective == "reslice":
        return resliced(link, slices, elem_bytes, gather)
    if collective == "ring" or len(set(slices)) <= 1:
        exchange = padded_ring(link, slices, elem_bytes)
        return Exchange("all-gather", link, exchange.sent, exchange.received) if gather else exchange
    return rooted(link, slices, elem_bytes)


def bucket_seconds(link: Link, slices: Sequence[int], grad_bytes: int, param_bytes: int, collective: str) -> float:
    """Seconds of a bucket's reduction (`grad_bytes` per element) and gather (`param_bytes`):
    what `bucket_exchange` prices both ways, from the busiest rank's elements alone."""
    steps, elements = bucket_load(link.size, slices, collective)
    return 2 * steps * link.latency + elements * (grad_bytes + param_bytes) / link.bandwidth


def bucket_load(n: int, slices: Sequence[int], collective: str) -> tuple[int, int]:
    """(α steps, elements) on the busiest rank of a group of `n` in one direction (the
    reduction or the gather) of a bucket cut into `slices`, in the form `collective`."""
    return _load(n, slices, _SliceFigures.of(slices), collective)


@dataclass(frozen=True)
class _SliceFigures:
    """What every form but `reslice` prices a bucket's slices by."""

    total: int
    largest: int
    smallest: int
    nonempty: int

    @classmethod
    def of(cls, slices: Sequence[int]) -> _SliceFigures:
        """The figures of `slices`."""
        listed = list(slices)
        return cls(sum(listed), max(listed, default=0), min(listed, default=0), len(listed) - listed.count(0))


def _load(n: int, slices: Sequence[int], figures: _SliceFigures, collective: str) -> tuple[int, int]:
    """`bucket_load`, from the slices' `figures` (worked out once per bucket)."""
    total, largest, smallest = figures.total, figures.largest, figures.smallest
    if n <= 1 or total <= 0:
        return 0, 0
    if collective == "all_to_all":
        return n - 1, max((n - 1) * largest, total - smallest)
    if collective == "reslice":
        spill = max(max(pair) for pair in reslice_moves(slices))
        return n - 1 + (1 if spill else 0), (n - 1) * -(-total // n) + spill
    if collective == "ring" or largest == smallest:
        return n - 1, (n - 1) * largest
    return figures.nonempty * math.ceil(math.log2(n)), total - smallest


def _cheapest(link: Link, slices: Sequence[int], param_bytes: int, grad_bytes: int) -> tuple[float, int]:
    """(seconds, index in `BUCKET_COLLECTIVES`) of the cheapest form (ties: the first). The
    ring over equal slices alone bounds `reslice` from below: where another form is no dearer,
    its spill-over (a pass over the ranks) is not worked out."""
    n, figures, moved = link.size, _SliceFigures.of(slices), grad_bytes + param_bytes
    floor = 2 * (n - 1) * link.latency + (n - 1) * -(-figures.total // max(n, 1)) * moved / link.bandwidth
    best = (math.inf, 0)
    for index, collective in enumerate(BUCKET_COLLECTIVES):
        if collective == "reslice" and best[0] <= floor:
            continue
        steps, elements = _load(n, slices, figures, collective)
        best = min(best, (2 * steps * link.latency + elements * moved / link.bandwidth, index))  # as bucket_seconds
    return best


def cheapest_seconds(link: Link, slices: Sequence[int], param_bytes: int, grad_bytes: int = GRAD_BYTES) -> float:
    """`bucket_seconds` of a bucket's cheapest form (`choose_collective`'s)."""
    return _cheapest(link, slices, param_bytes, grad_bytes)[0]


def choose_collective(link: Link, slices: Sequence[int], param_bytes: int, grad_bytes: int = GRAD_BYTES) -> str:
    """The cheapest form of a bucket's reduction plus gather on `link` (ties: the first of
    `BUCKET_COLLECTIVES`, so a group of one keeps the default)."""
    return BUCKET_COLLECTIVES[_cheapest(link, slices, param_bytes, grad_bytes)[1]]


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
            merged[key] = Exchange(
                ex.kind,
                ex.link,
                tuple(a + b for a, b in zip(old.sent, ex.sent)),
                tuple(a + b for a, b in zip(old.received, ex.received)),
                max(old.steps(), ex.steps()),
            )
        else:
            merged[key] = ex
    return sum(ex.seconds() for ex in (*merged.values(), *rest))
