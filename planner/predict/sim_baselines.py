"""The baselines canzona is compared with, priced on the same schedule and hardware model as canzona.

Every baseline handles TP the synchronous way (TP-SC): a DP rank's matrices are all-gathered
over its TP group in one fused all-gather (fp32 gradient shards; replicated matrices need
none) and every TP rank updates every one of them. What differs is the DP side. Every strategy
overlaps its collectives under the same settings (`Instance.overlap_grad`: gradient reductions
and all-reduces with backward; `Instance.overlap_param`: per-bucket parameter all-gathers with
the next forward), where it has such collectives:

- `tp-sc`: canzona's DP cuts, owners and collectives (and canzona's overlap options); only the
  TP side is synchronous.
- `dp-sc` (DDP): all-reduce of every bucket; every DP rank updates every matrix (its EP rank's
  experts) and the whole AdamW buffer; nothing to gather.
- `zero1-gather` (Megatron's distributed optimizer, Moonlight-style): equal reduce-scatter; a
  rank fetches the rest of every matrix touching its slice (one point-to-point round per
  bucket) and updates them all; equal all-gather.
- `start-owner`: as zero1-gather, but the rank where a matrix starts fetches its spill-over,
  updates it and returns the spilled part (param dtype) before the all-gather.
- `layer-wise` (Megatron's layer-wise optimizer): all-reduce of every matrix bucket; whole
  matrices to ranks by LPT on predicted seconds; each updated matrix broadcast from its owner
  after the update (never overlapped: one broadcast per matrix, no bucket to wait for), then
  the AdamW all-gather.
- `ddp-adamw`: a reference, not a matrix optimizer: DDP (all-reduce) and AdamW on every local
  element of every device.

A point-to-point round costs one α: every pair talks at once and only neighbours do.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from canzona.planner.partition.collectives import GRAD_BYTES, Exchange, all_reduce, broadcast
from canzona.planner.partition.layout import equal_cuts, slice_owner
from canzona.planner.predict.step import (
    ADAMW_BUFFER,
    DENSE,
    EXPERT,
    BucketSync,
    Buffer,
    DpPhases,
    Instance,
    Local,
    Matrix,
    StrategyTime,
    Work,
    adamw_sync,
    combine,
    dp_sync,
    matrix_work,
    replicated_locals,
    schedule_phases,
    synchronous_locals,
)

Owners = Callable[[Buffer, int], list[list[Matrix]]]
REFERENCES = ("ddp-adamw",)  # strategies that are not matrix-optimizer baselines


def by_touch(buffer: Buffer, n: int) -> list[list[Matrix]]:
    """Every matrix touching a rank's equal slice (zero1-gather)."""
    ranks: list[list[Matrix]] = [[] for _ in range(n)]
    for numel, bucket in zip(buffer.numel, buffer.entries):
        cuts = equal_cuts(numel, n)
        for m in bucket:
            for rank in range(slice_owner(cuts, m.offset), slice_owner(cuts, m.offset + max(m.numel, 1) - 1) + 1):
                ranks[rank].append(m)
    return ranks


def by_start(buffer: Buffer, n: int) -> list[list[Matrix]]:
    """Every matrix to the rank whose equal slice holds its start (start-owner)."""
    ranks: list[list[Matrix]] = [[] for _ in range(n)]
    for numel, bucket in zip(buffer.numel, buffer.entries):
        cuts = equal_cuts(numel, n)
        for m in bucket:
            ranks[slice_owner(cuts, m.offset)].append(m)
    return ranks


def by_lpt(buffer: Buffer, n: int) -> list[list[Matrix]]:
    """Whole matrices by LPT on predicted seconds, ignoring buffer order (layer-wise)."""
    ranks: list[list[Matrix]] = [[] for _ in range(n)]
    heap = [(0.0, rank) for rank in range(n)]
    for m in sorted((m for bucket in buffer.entries for m in bucket), key=lambda m: (-m.seconds, m.name)):
        load, rank = heapq.heappop(heap)
        ranks[rank].append(m)
        heapq.heappush(heap, (load + m.seconds, rank))
    return ranks


def spill(buffer: Buffer, n: int, everyone: bool, back: bool = False, elem_bytes: int = GRAD_BYTES) -> list[Exchange]:
    """Point-to-point rounds moving the parts of matrices that cross equal slices: to every
    rank touching them (`everyone`, zero1-gather) or to the start rank only (start-owner);
    `back` returns the updated spilled parts from the start rank to the slice holders."""
    out = []
    for numel, bucket in zip(buffer.numel, buffer.entries):
        cuts = equal_cuts(numel, n)
        sent, received = [0.0] * n, [0.0] * n
        for m in bucket:
            first, last = slice_owner(cuts, m.offset), slice_owner(cuts, m.offset + max(m.numel, 1) - 1)
            for rank in range(first, last + 1):
                part = (min(m.offset + m.numel, cuts[rank + 1]) - max(m.offset, cuts[rank])) * elem_bytes
                if everyone:
                    received[rank] += m.numel * elem_bytes - part
                    sent[rank] += part * (last - first)
                elif rank == first:
                    received[rank] += m.numel * elem_bytes - part
                else:
                    sent[rank] += part
        if any(sent):
            out.append(
                Exchange("p2p", buffer.link, tuple(received if back else sent), tuple(sent if back else received))
            )
    return out


def _per_buffer(inst: Instance, owners: Owners) -> tuple[list[Work], list[list[Work]]]:
    dense = [matrix_work(ms) for ms in owners(inst.dense, inst.dp)]
    experts = [[matrix_work(ms) for ms in owners(buffer, inst.dp // inst.ep)] for buffer in inst.experts]
    return dense, experts


def _buffers(inst: Instance) -> list[tuple[str, Buffer]]:
    return [(DENSE, inst.dense)] + ([(EXPERT, inst.experts[0])] if inst.experts else [])


def _equal_sync(inst: Instance, gather: bool) -> list[BucketSync]:
    out = []
    for name, buffer in _buffers(inst):
        cuts = [equal_cuts(numel, buffer.link.size) for numel in buffer.numel]
        out += dp_sync(inst, cuts, buffer, gather, name, equal=True)
    return out + adamw_sync(inst, gather)


def _all_reduces(inst: Instance, adamw: bool) -> list[BucketSync]:
    """One ring all-reduce per matrix bucket (and per AdamW bucket when `adamw`)."""
    out = [
        BucketSync(name, bucket, all_reduce(buffer.link, numel, GRAD_BYTES))
        for name, buffer in _buffers(inst)
        for bucket, numel in enumerate(buffer.numel)
    ]
    if adamw:
        out += [
            BucketSync(ADAMW_BUFFER, bucket, all_reduce(inst.dp_link, numel, GRAD_BYTES))
            for bucket, numel in enumerate(inst.adamw_numel)
        ]
    return out


def tp_sc(inst: Instance) -> StrategyTime:
    """canzona's DP partition with a synchronous (duplicated) TP update."""
    return combine(
        "tp-sc",
        "canzona's DP cuts; every TP rank all-gathers each owned matrix (one fused "
        "all-gather) and updates it redundantly",
        inst.tp,
        schedule_phases(inst),
        replicated_locals(inst),
        inst.fused,
    )


def dp_sc(inst: Instance) -> StrategyTime:
    """Plain data parallelism: all-reduce, everything updated everywhere."""

    def everything(buffer: Buffer, n: int) -> list[Work]:
        return [matrix_work([m for bucket in buffer.entries for m in bucket])] * n

    dense = everything(inst.dense, inst.dp)
    experts = [everything(buffer, inst.dp // inst.ep) for buffer in inst.experts]
    total_adamw = sum(inst.adamw_numel)
    locals_ = synchronous_locals(inst, dense, experts, lambda rank: total_adamw)
    phases = DpPhases(reduce=tuple(_all_reduces(inst, adamw=True)), overlap_grad=inst.overlap_grad)
    return combine(
        "dp-sc",
        "all-reduce of every bucket; every DP rank updates every "
        "matrix (TP-SC under TP) and the whole AdamW buffer; no all-gather",
        inst.tp,
        phases,
        locals_,
        inst.fused,
    )


def zero1_gather(inst: Instance) -> StrategyTime:
    """Equal slices; every matrix touching a slice is fetched whole and updated there."""
    dense, experts = _per_buffer(inst, by_touch)
    locals_ = synchronous_locals(inst, dense, experts, inst.adamw_elements)
    fetch = tuple(ex for _, b in _buffers(inst) for ex in spill(b, b.link.size, everyone=True))
    phases = DpPhases(
        reduce=tuple(_equal_sync(inst, gather=False)),
        fetch=fetch,
        gather=tuple(_equal_sync(inst, gather=True)),
        overlap_grad=inst.overlap_grad,
        overlap_param=inst.overlap_param,
    )
    return combine(
        "zero1-gather",
        "equal reduce-scatter; each rank fetches the rest of every matrix touching its "
        "slice and updates them all (TP-SC under TP); equal all-gather",
        inst.tp,
        phases,
        locals_,
        inst.fused,
    )


def start_owner(inst: Instance) -> StrategyTime:
    """Equal slices; a matrix is updated by the rank where it starts."""
    dense, experts = _per_buffer(inst, by_start)
    locals_ = synchronous_locals(inst, dense, experts, inst.adamw_elements)
    fetch = tuple(ex for _, b in _buffers(inst) for ex in spill(b, b.link.size, everyone=False))
    back = tuple(
        ex
        for _, b in _buffers(inst)
        for ex in spill(
            b,
            b.link.size,
            everyone=False,
            back=True,
            elem_bytes=inst.gather_bytes(b.param_bytes[0] if b.param_bytes else 2),
        )
    )
    phases = DpPhases(
        reduce=tuple(_equal_sync(inst, gather=False)),
        fetch=fetch,
        publish=back,
        gather=tuple(_equal_sync(inst, gather=True)),
        overlap_grad=inst.overlap_grad,
        overlap_param=inst.overlap_param,
    )
    return combine(
        "start-owner",
        "equal reduce-scatter; the rank where a matrix starts fetches its spill-over, "
        "updates it (TP-SC under TP) and returns the spilled part; equal all-gather",
        inst.tp,
        phases,
        locals_,
        inst.fused,
    )


def layer_wise(inst: Instance) -> StrategyTime:
    """Whole matrices balanced by LPT; all-reduce, then a broadcast per matrix."""
    dense, experts = _per_buffer(inst, by_lpt)
    locals_ = synchronous_locals(inst, dense, experts, inst.adamw_elements)
    casts = tuple(
        broadcast(b.link, m.numel * inst.gather_bytes(m.param_bytes))
        for _, b in _buffers(inst)
        for bucket in b.entries
        for m in bucket
    )
    phases = DpPhases(
        reduce=tuple(_all_reduces(inst, adamw=False) + adamw_sync(inst, gather=False)),
        publish=casts,
        gather=tuple(adamw_sync(inst, gather=True)),
        overlap_grad=inst.overlap_grad,
        overlap_param=inst.overlap_param,
    )
    return combine(
        "layer-wise",
        "all-reduce of every matrix bucket; whole matrices "
        "to ranks by LPT on predicted seconds (TP-SC under TP); each updated matrix broadcast from "
        "its owner; AdamW on equal slices",
        inst.tp,
        phases,
        locals_,
        inst.fused,
    )


def ddp_adamw(inst: Instance) -> StrategyTime:
    """Reference: DDP all-reduce overlapped with backward, AdamW on every local element."""
    local_elements = sum(inst.dense.numel) + (sum(inst.experts[0].numel) if inst.experts else 0) + sum(inst.adamw_numel)
    seconds = inst.time_model.adamw_cost(local_elements)
    locals_ = [Local(seconds, (seconds,) * inst.tp, 0.0)] * inst.dp
    phases = DpPhases(reduce=tuple(_all_reduces(inst, adamw=True)), overlap_grad=inst.overlap_grad)
    return combine(
        "ddp-adamw",
        "reference, not a matrix optimizer: DDP all-reduce of every bucket and AdamW on "
        "every parameter of every device",
        inst.tp,
        phases,
        locals_,
        inst.fused,
    )


def baseline_times(inst: Instance) -> tuple[StrategyTime, ...]:
    """Every baseline, in a fixed order, then the references."""
    return (tp_sc(inst), dp_sc(inst), zero1_gather(inst), start_owner(inst), layer_wise(inst), ddp_adamw(inst))
