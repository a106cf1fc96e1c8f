"""The DP bucket buffer and the TP tasks of a schedule (`canzona.schedules.layout`): every
element in exactly one place, each parameter one run of its bucket, micro-groups as the tp
section records them, and uneven TP shards at the start of their slots."""

from __future__ import annotations

import json
from functools import cache
from math import prod
from pathlib import Path

from canzona.planner.compile import compile_schedule
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.load import load_model
from canzona.schedules.format import Schedule
from canzona.schedules.layout import Piece, build_dp_layout, local_shape, micro_groups

TINY_MOE = Path(__file__).resolve().parents[1] / "runtime" / "data" / "tiny_moe.json"


def planned(model: Path, tp: int, dp: int, bucket_size: int = 4000) -> Schedule:
    """A planner-made schedule with small buckets and micro-groups (several of each)."""
    request = PlanRequest(str(model), tp, dp, bucket_size=bucket_size, group_bytes=4096)
    return compile_schedule(make_plan(load_model(str(model), tp), request))


@cache
def tiny() -> Schedule:
    return planned(TINY_MOE, 2, 2)


def test_every_element_lies_in_exactly_one_slice() -> None:
    """Every element of every parameter lies in exactly one rank's slice, at its own position;
    a matrix lies whole in its owner's slice."""
    schedule = tiny()
    layout = build_dp_layout(schedule)
    assert layout.total == sum(b.numel for b in schedule.dp.buckets) + sum(b.numel for b in schedule.dp.adamw_buckets)
    covered = [0] * layout.total
    per_param: dict[int, int] = {}
    for rank, pieces in enumerate(layout.rank_pieces):
        for piece in pieces:
            for position in range(piece.pos, piece.pos + piece.length):
                covered[position] += 1
            per_param[piece.param] = per_param.get(piece.param, 0) + piece.length
            assert piece.pos == layout.flat[piece.param] + piece.src
            start, stop = layout.buckets[layout.bucket_of[piece.param]].slice_of(rank)  # type: ignore[misc]
            assert start <= piece.pos and piece.pos + piece.length <= stop
    assert max(covered) == 1
    assert all(per_param[e.index] == e.numel for e in schedule.params)
    for entry in schedule.params:
        if entry.optimizer == "matrix":
            (piece,) = [p for p in layout.rank_pieces[entry.owner] if p.param == entry.index]
            assert piece.length == entry.numel


def test_each_parameter_is_one_run_of_its_bucket() -> None:
    """Every parameter is one contiguous run of its bucket; no two overlap."""
    schedule = tiny()
    layout = build_dp_layout(schedule)
    runs = sorted((layout.flat[e.index], layout.flat[e.index] + e.numel) for e in schedule.params)
    assert all(a[1] <= b[0] for a, b in zip(runs, runs[1:]))
    for entry in schedule.params:
        bucket = layout.buckets[layout.bucket_of[entry.index]]
        assert bucket.kind == entry.optimizer and bucket.index == entry.bucket and entry.index in bucket.params
        assert (
            bucket.base <= layout.flat[entry.index]
            and layout.flat[entry.index] + entry.numel <= bucket.base + bucket.numel
        )
    assert sum(b.numel for b in layout.buckets) == layout.total


def test_micro_groups_follow_the_tp_section() -> None:
    schedule = tiny()
    for plan in schedule.tp.ranks:
        groups = micro_groups(schedule, plan.dp_rank)
        assert [[t.host for t in g] for g in groups] == [g.hosts for g in plan.groups]
    assert sum(len(r.groups) for r in schedule.tp.ranks) > 2  # small capacity: several groups


def test_uneven_tp_shards_fill_the_start_of_their_slots(tmp_path: Path) -> None:
    """TP 3 over dims of 7 and 5 (torch.chunk: 3, 3, 1 and 2, 2, 1): every TP rank's pieces
    cover exactly its own shard, once, from the start of each parameter's slot."""
    params = [
        {"name": "w", "shape": [7, 6], "tp_dim": 0},
        {"name": "v", "shape": [4, 5], "tp_dim": 1},
        {"name": "b", "shape": [5], "tp_dim": 0, "optimizer": "adamw"},
    ]
    path = tmp_path / "uneven.json"
    path.write_text(json.dumps({"name": "uneven", "params": params}))
    schedule = planned(path, 3, 2, bucket_size=16)
    for tp_rank in range(3):
        layout = build_dp_layout(schedule, 0, tp_rank)
        for entry in schedule.params:
            pieces = sorted(
                (p for rank in layout.rank_pieces for p in rank if p.param == entry.index), key=lambda p: p.src
            )
            numel = prod(local_shape(entry, 3, tp_rank))
            assert [(p.src, p.src + p.length) for p in pieces] == _chained(pieces), entry.name
            assert sum(p.length for p in pieces) == numel <= entry.numel, (entry.name, tp_rank)
            assert all(p.pos == layout.flat[entry.index] + p.src for p in pieces)
    assert [local_shape(e, 3, r) for e in schedule.params if e.name == "w" for r in range(3)] == [
        (3, 6),
        (3, 6),
        (1, 6),
    ]


def _chained(pieces: list[Piece]) -> list[tuple[int, int]]:
    """The runs `pieces` would be if they followed each other from 0 without a gap."""
    out, start = [], 0
    for piece in pieces:
        out.append((start, start + piece.length))
        start += piece.length
    return out
