"""The per-rank plan: everything a step needs to know about this rank, computed once at
construction from the schedule and the parameters bound to it, then frozen.

`RankPlan` holds indices and offsets only (and references to the bound parameters): which
schedule entries this rank optimizes, where each one's gradient lies in the bucket buffer, which
slices of which buckets it updates, its AdamW pieces and their places in the AdamW state, the
micro-groups its TP group runs and the matrices it hosts, the spans that count towards the
gradient norm and those summed over TP. The stages of a step (`canzona.runtime.engine`) read it;
nothing changes it.

Coordinates: a *position* is an offset into the bucket buffer (`canzona.schedules.layout`: every
DP bucket whole, one after the other), where gradients are packed and reduced in place and,
after the update, the new values are gathered. A rank's *slices* are the parts of every bucket
it updates (its own, or every rank's under DP-SC).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from functools import cached_property
from math import prod
from typing import Any

import torch

from canzona.runtime import binding
from canzona.runtime.binding import Bound
from canzona.runtime.schedule import DTYPES
from canzona.schedules.format import Schedule
from canzona.schedules.layout import (
    DpLayout,
    Piece,
    Task,
    build_dp_layout,
    hosts_here,
    local_entries,
    local_shape,
    micro_groups,
    owned_tasks,
)
from canzona.schedules.limits import ADAMW, REPLICATED_UPDATE

Span = tuple[int, int]  # [start, stop) of the bucket buffer


@dataclass(frozen=True)
class Strategy:
    """How a rank divides the matrix work. `canzona`: each DP rank updates its own slices, each
    matrix on its host TP rank (or team). `tp-sc`: the same DP slices, but every TP rank
    gathers and updates every owned matrix in full. `dp-sc`: every DP rank updates everything
    (all-reduced gradients, nothing gathered after)."""

    name: str
    tp_replicated: bool = False
    all_dp: bool = False


CANZONA = Strategy("canzona")
CANZONA_REPLICATED = Strategy("canzona-replicated", tp_replicated=True)  # a schedule's replicated TP update
TP_SC = Strategy("tp-sc", tp_replicated=True)
DP_SC = Strategy("dp-sc", tp_replicated=True, all_dp=True)


def strategy_for(default: Strategy, schedule: Schedule) -> Strategy:
    """The strategy a rank runs: canzona's follows its schedule's TP update (replicated: every
    TP rank updates every matrix its DP rank owns, as TP-SC does); a baseline's is its own."""
    if default == CANZONA and schedule.tp.update == REPLICATED_UPDATE:
        return CANZONA_REPLICATED
    return default


@dataclass(frozen=True)
class Place:
    """Where this rank sits: DP rank and size, TP rank and size, EP size and its EP rank."""

    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    ep: int = 1

    @property
    def ep_rank(self) -> int:
        """This rank's EP rank (its DP rank mod the EP size)."""
        return self.dp_rank % self.ep


@dataclass(frozen=True)
class AdamwPiece:
    """`length` AdamW elements of entry `param`: from `src` in its local tensor, at position
    `pos` of the bucket buffer and at `offset` in this rank's AdamW state vectors."""

    param: int
    src: int
    pos: int
    offset: int
    length: int


@dataclass(frozen=True)
class RankPlan:
    """This rank's part of a schedule (module docstring). Per-entry tuples are indexed by the
    schedule's registration index; `bound[i]` is None for an entry this rank does not optimize
    (frozen, not passed, another EP rank's expert)."""

    schedule: Schedule
    place: Place
    strategy: Strategy
    device: torch.device
    names: tuple[str, ...]
    tp_dims: tuple[int | None, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]  # full (unsharded) shapes
    numel: tuple[int, ...]  # elements of this rank's TP shard (its slot in the buffer may be longer)
    expert: tuple[bool, ...]
    counted: tuple[bool, ...]  # step counts kept (every entry but this rank's frozen ones)
    bound: tuple[Bound | None, ...]
    group_of: tuple[int, ...]  # the optimizer param group of each optimized entry (-1: none)
    tensor_entries: Mapping[int, tuple[int, ...]]  # id(model parameter) -> the entries it holds
    layout: DpLayout
    ranks: tuple[int, ...]  # DP ranks whose slices this rank updates
    groups: tuple[tuple[Task, ...], ...]  # the micro-groups this rank's TP group runs (any host)
    tasks: Mapping[int, Task]  # every matrix this rank hosts (or shares in a team), frozen ones too
    adamw: tuple[AdamwPiece, ...]  # the AdamW pieces of this rank's slices (frozen ones too), in buffer order
    adamw_numel: int  # length of this rank's AdamW state vectors (its AdamW slices, padding included)
    update_spans: tuple[Span, ...]  # the gradients this rank's update reads (its slices' optimized entries)
    norm_spans: tuple[Span, ...]  # what this rank counts towards the global gradient norm
    partial_spans: tuple[Span, ...]  # gradients of this rank's slices summed over TP

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype updated values travel in over DP: the model's one dtype, else fp32 (exact
        for bf16 and fp16 alike)."""
        found = set(self.dtypes)
        return found.pop() if len(found) == 1 else torch.float32

    @cached_property
    def managed(self) -> tuple[int, ...]:
        """The entries this rank optimizes, in registration order."""
        return tuple(i for i, b in enumerate(self.bound) if b is not None)

    def lowp(self, index: int) -> bool:
        """Whether entry `index` is bf16 / fp16 (updated through an fp32 main copy)."""
        return self.dtypes[index] != torch.float32

    def value(self, index: int) -> torch.Tensor:
        """This rank's values of entry `index`: a view of the model's parameter, outside autograd
        (writing it writes the parameter)."""
        bound = self.bound[index]
        assert bound is not None, f"{self.names[index]} is not optimized here"
        return bound.value.detach()

    def grad_span(self, index: int) -> Span:
        """Where entry `index`'s gradient lies in the bucket buffer."""
        start = self.layout.flat[index]
        return start, start + self.numel[index]

    @cached_property
    def hosted(self) -> tuple[int, ...]:
        """The matrices this rank hosts (frozen ones too: their state is kept), in micro-group order."""
        return tuple(self.tasks)

    def model_params(self) -> Iterator[tuple[torch.Tensor, tuple[int, ...]]]:
        """Every optimized model parameter, with the entries it holds (a grouped expert tensor
        holds several)."""
        for indices in self.tensor_entries.values():
            bound = self.bound[indices[0]]
            assert bound is not None
            yield bound.param, indices

    def optimized(self, index: int) -> bool:
        """Whether this rank optimizes entry `index`."""
        return self.bound[index] is not None

    @cached_property
    def own_pieces(self) -> tuple[Piece, ...]:
        """The pieces of this DP rank's own slices (what it sends in the DP gather)."""
        return self.layout.rank_pieces[self.place.dp_rank]

    def writes_matrix(self, param: int) -> bool:
        """Whether this rank's checkpoint holds matrix `param`'s state (one copy of each)."""
        if not self.strategy.tp_replicated:
            return True
        home = self.place.ep_rank if self.expert[param] else 0
        return self.place.tp_rank == 0 and (not self.strategy.all_dp or self.place.dp_rank == home)

    def writes_adamw(self, param: int) -> bool:
        """Whether this rank's checkpoint holds its AdamW state of entry `param`."""
        replicated = self.tp_dims[param] is None
        if self.strategy.all_dp and self.place.dp_rank != 0:
            return False
        return not replicated or self.place.tp_rank == 0


def merged(spans: Iterable[Span]) -> tuple[Span, ...]:
    """`spans` (in order) with adjacent ones joined."""
    out: list[Span] = []
    for start, stop in spans:
        if out and out[-1][1] == start:
            out[-1] = (out[-1][0], stop)
        elif stop > start:
            out.append((start, stop))
    return tuple(out)


def _piece_span(piece: Piece) -> Span:
    return piece.pos, piece.pos + piece.length


def _bind(
    schedule: Schedule, param_groups: list[dict[str, Any]], ep_rank: int
) -> tuple[list[Bound | None], list[int], dict[int, tuple[int, ...]]]:
    """Every schedule entry bound to the model tensor holding it (`canzona.runtime.binding`)."""
    held = local_entries(schedule, ep_rank)
    by_name, slices = binding.model_entries(held), binding.slices_of(held)
    count = len(schedule.params)
    bound: list[Bound | None] = [None] * count
    group_of = [-1] * count
    tensor_entries: dict[int, list[int]] = {}
    for position, group in enumerate(param_groups):
        for name, tensor in zip(group["param_names"], group["params"]):
            for index, binding_ in binding.bind(name, tensor, by_name, slices):
                bound[index], group_of[index] = binding_, position
                tensor_entries.setdefault(id(tensor), []).append(index)
    return bound, group_of, {key: tuple(value) for key, value in tensor_entries.items()}


def _matrix_work(
    schedule: Schedule, place: Place, strategy: Strategy, ranks: tuple[int, ...]
) -> tuple[tuple[tuple[Task, ...], ...], dict[int, Task]]:
    """The micro-groups of this rank's TP group and the matrices this rank updates."""
    if strategy.tp_replicated:
        owned = tuple(owned_tasks(schedule, list(ranks), place.ep_rank))
        return (owned,), {t.param: t for t in owned}
    groups = tuple(micro_groups(schedule, place.dp_rank))
    return groups, {t.param: t for tasks in groups for t in tasks if hosts_here(t, place.tp_rank)}


def _adamw_pieces(layout: DpLayout, ranks: tuple[int, ...]) -> tuple[tuple[AdamwPiece, ...], int]:
    """The AdamW pieces of `ranks`' slices (frozen parameters' too: their state stays as it
    started, and checkpoints carry it) with their state offsets (the state vectors hold the
    ranks' AdamW slices one after the other, in buffer order), and the vectors' length."""
    pieces, offset = [], 0
    for rank in ranks:
        for bucket in (b for b in layout.buckets if b.kind == ADAMW):
            span = bucket.slice_of(rank)
            if span is None:
                continue
            start, stop = span
            for piece in layout.rank_pieces[rank]:
                if start <= piece.pos < stop:
                    pieces.append(
                        AdamwPiece(piece.param, piece.src, piece.pos, offset + piece.pos - start, piece.length)
                    )
            offset += stop - start
    return tuple(pieces), offset


def build_rank_plan(
    schedule: Schedule, param_groups: list[dict[str, Any]], place: Place, strategy: Strategy = CANZONA
) -> RankPlan:
    """This rank's plan: `param_groups` are the optimizer's groups ("params" and
    "param_names"), checked against the schedule beforehand."""
    entries = sorted(schedule.params, key=lambda e: e.index)
    bound, group_of, tensor_entries = _bind(schedule, param_groups, place.ep_rank)
    layout = build_dp_layout(schedule, place.ep_rank, place.tp_rank)
    ranks = tuple(range(place.dp_size)) if strategy.all_dp else (place.dp_rank,)
    groups, tasks = _matrix_work(schedule, place, strategy, ranks)
    adamw, adamw_numel = _adamw_pieces(layout, ranks)
    tp_dims = tuple(e.tp_dim for e in entries)
    partial = tuple(e.grad_reduce == binding.PARTIAL_OVER_TP for e in entries)
    local = {e.index for e in local_entries(schedule, place.ep_rank)}
    own = [p for p in layout.rank_pieces[place.dp_rank] if bound[p.param] is not None]
    counted_once = [p for p in own if place.tp_rank == 0 or tp_dims[p.param] is not None]
    mine = [p for rank in ranks for p in layout.rank_pieces[rank]]
    device = next((b.value.device for b in bound if b is not None), torch.device("cpu"))
    return RankPlan(
        schedule=schedule,
        place=place,
        strategy=strategy,
        device=device,
        names=tuple(e.name for e in entries),
        tp_dims=tp_dims,
        dtypes=tuple(DTYPES[e.dtype] for e in entries),
        shapes=tuple(tuple(e.shape) for e in entries),
        numel=tuple(prod(local_shape(e, place.tp_size, place.tp_rank)) for e in entries),
        expert=tuple(e.ep_rank is not None for e in entries),
        # another EP rank's experts count too: the ranks agree which entries had a gradient
        counted=tuple(bound[i] is not None or i not in local for i in range(len(entries))),
        bound=tuple(bound),
        group_of=tuple(group_of),
        tensor_entries=tensor_entries,
        layout=layout,
        ranks=ranks,
        groups=groups,
        tasks=tasks,
        adamw=adamw,
        adamw_numel=adamw_numel,
        update_spans=merged(_piece_span(p) for p in mine if bound[p.param] is not None),
        norm_spans=merged(_piece_span(p) for p in counted_once),
        partial_spans=merged(_piece_span(p) for p in mine if partial[p.param] and bound[p.param] is not None),
    )
