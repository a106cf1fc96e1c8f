"""Checkpoints through torch.distributed.checkpoint move between schedules: k steps under
TP 1 x DP 4, save, load under TP 2 x DP 2 with another α and bucket size, m more steps: the
parameters equal an uninterrupted single-process reference run (fp32, rtol 1e-5) for Muon,
Shampoo and SOAP (also in memory: every rank's state_dict merged, then loaded; through a plain
`dcp.save` / `dcp.load` of a `DcpState`, as DCP-based checkpointers save it; and from the
TP-SC baseline to the DP-SC one: the logical state does not depend on the strategy either). The
model's vocab (300) pads to 384 rows at TP 1 and 512 at TP 2, so the AdamW embedding and output
states also cross a padding change. Under one schedule, save and load is bit-exact."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from canzona.runtime import CanzonaOptimizer, load_checkpoint, merge_state_dicts, save_checkpoint
from canzona.runtime.schedule import DTYPES
from canzona.runtime.state.stateful import DcpState
from canzona.runtime.tools.reference import ReferenceOptimizer
from canzona.schedules.format import ParamEntry, Schedule
from canzona.schedules.reshard import reshard_report

from rt_harness import DATA, labelled, make_groups, make_schedule, run_ranks
from rt_oracle import STRATEGIES, ordered, shard

MODEL = DATA / "tiny_moe_v300.json"
VOCAB = 300
K, M = 3, 3
SETTINGS: dict[str, dict[str, Any]] = {
    "muon": {},
    "shampoo": {"block_size": 16, "precondition_frequency": 2},
    "soap": {"precondition_frequency": 2, "max_precond_dim": 40},
}
HP = {"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 0.01, "adamw_weight_decay": 0.01}


def _generator(*key: Any) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _real_rows(entry: ParamEntry) -> int:
    """Rows that are not vocab padding (padding rows start at zero and get no gradient)."""
    return min(entry.shape[0], VOCAB) if entry.optimizer == "adamw" and len(entry.shape) == 2 else entry.shape[0]


def _padded(core: torch.Tensor, entry: ParamEntry) -> torch.Tensor:
    out = torch.zeros(entry.shape)
    out[: core.shape[0]] = core
    return out


def canonical_init(entry: ParamEntry) -> torch.Tensor:
    """Initial value in canonical layout (fc1 rows [gate; up]), independent of TP."""
    shape = (_real_rows(entry), *entry.shape[1:])
    return _padded(torch.randn(shape, generator=_generator("init", entry.name)) * 0.1, entry)


def canonical_grad(entry: ParamEntry, step: int, dp_rank: int) -> torch.Tensor:
    """DP rank `dp_rank`'s gradient at `step`, canonical layout, zero on padding rows."""
    shape = (_real_rows(entry), *entry.shape[1:])
    shared = torch.randn(shape, generator=_generator("grad", entry.name, step))
    own = torch.randn(shape, generator=_generator("noise", entry.name, step, dp_rank))
    return _padded(shared + 0.5 * own, entry)


def _fused_fc1(entry: ParamEntry) -> bool:
    return "linear_fc1.weight" in entry.name


def to_gathered(entry: ParamEntry, canonical: torch.Tensor, tp: int) -> torch.Tensor:
    """Canonical fc1 [gate; up] -> the gathered TP layout [gate_0; up_0; gate_1; up_1; ...]."""
    if not _fused_fc1(entry) or tp == 1:
        return canonical
    gate, up = canonical.chunk(2)
    return torch.cat([part for t in range(tp) for part in (gate.chunk(tp)[t], up.chunk(tp)[t])])


def to_canonical(entry: ParamEntry, gathered: torch.Tensor, tp: int) -> torch.Tensor:
    """The inverse of `to_gathered`."""
    if not _fused_fc1(entry) or tp == 1:
        return gathered
    halves = [s.chunk(2) for s in gathered.chunk(tp)]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


def _rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """The first `rows` rows, zero-padded when the tensor has fewer (vocab padding)."""
    out = torch.zeros((rows, *tensor.shape[1:]))
    common = min(rows, tensor.shape[0])
    out[:common] = tensor[:common]
    return out


def _local_params(
    schedule: Schedule, canonical: dict[str, torch.Tensor], tp_rank: int
) -> list[tuple[str, torch.nn.Parameter]]:
    tp = schedule.request.tp
    return [
        (
            e.name,
            torch.nn.Parameter(
                shard(to_gathered(e, _rows(canonical[e.name], e.shape[0]), tp), e, tp_rank, tp).to(DTYPES[e.dtype])
            ),
        )
        for e in ordered(schedule)
    ]


def _train(optimizer: CanzonaOptimizer, schedule: Schedule, params: list[tuple[str, Any]], steps: range) -> None:
    tp = schedule.request.tp
    dp_rank, tp_rank = optimizer.dp_rank, optimizer.tp_rank
    for step in steps:
        for entry, (_, param) in zip(ordered(schedule), params):
            param.grad = shard(to_gathered(entry, canonical_grad(entry, step, dp_rank), tp), entry, tp_rank, tp).to(
                param.dtype
            )
        optimizer.step()
        optimizer.zero_grad()


def _gather_canonical(
    schedule: Schedule, params: list[tuple[str, Any]], tp_group: dist.ProcessGroup
) -> dict[str, torch.Tensor]:
    """Full canonical parameters from this rank's TP shards (every DP rank holds the same)."""
    tp = schedule.request.tp
    out = {}
    for entry, (name, param) in zip(ordered(schedule), params):
        shards = [torch.empty_like(param.detach()) for _ in range(tp)]
        dist.all_gather(shards, param.detach().contiguous(), group=tp_group)
        full = shards[0] if entry.tp_dim is None else torch.cat(shards, dim=entry.tp_dim)
        out[name] = to_canonical(entry, full, tp)
    return out


def _move_state(optimizer: CanzonaOptimizer, folder: str | None, via: str) -> Any:
    """Save the state (to `folder` with canzona's checkpoint, or through `dcp.save` of a
    `DcpState` as a DCP-based checkpointer does; else every rank's state_dict in memory)."""
    if via == "stateful":
        return dcp.save({"optimizer": DcpState(optimizer)}, checkpoint_id=folder)
    if folder is not None:
        return save_checkpoint(optimizer, folder)
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, optimizer.state_dict())
    return merge_state_dicts(states)


def _reshard_worker(
    rank: int,
    world: int,
    first: Schedule,
    second: Schedule,
    folder: str | None,
    hp: dict[str, Any],
    strategies: tuple[str, str],
    via: str = "checkpoint",
) -> dict[str, torch.Tensor]:
    dp_group, tp_group = make_groups(first.request.dp, first.request.tp)
    params = _local_params(first, {e.name: canonical_init(e) for e in first.params}, rank % first.request.tp)
    optimizer = STRATEGIES[strategies[0]](params, first, dp_group=dp_group, tp_group=tp_group, **hp)
    _train(optimizer, first, params, range(K))
    saved = _move_state(optimizer, folder, via)
    canonical = _gather_canonical(first, params, tp_group)
    dp_group, tp_group = make_groups(second.request.dp, second.request.tp)
    params = _local_params(second, canonical, rank % second.request.tp)
    resumed = STRATEGIES[strategies[1]](params, second, dp_group=dp_group, tp_group=tp_group, **hp)
    if via == "stateful":
        dcp.load({"optimizer": DcpState(resumed)}, checkpoint_id=folder)
    elif folder is None:
        resumed.load_state_dict(saved)
    else:
        assert load_checkpoint(resumed, folder)["step"] == K
    assert resumed.step_count == K
    _train(resumed, second, params, range(K, K + M))
    return {name: param.detach().clone() for name, param in params}


def reference_run(schedule: Schedule, dp_per_step: list[int], hp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The single-process reference on canonical full tensors (`schedule` at TP 1), each step's
    gradient the mean over that step's DP ranks."""
    entries = ordered(schedule)
    params = [(e.name, torch.nn.Parameter(canonical_init(e).to(DTYPES[e.dtype]))) for e in entries]
    optimizer = ReferenceOptimizer(params, schedule, **hp)
    for step, dp in enumerate(dp_per_step):
        optimizer.step(
            {
                e.name: torch.stack([canonical_grad(e, step, d).to(DTYPES[e.dtype]).float() for d in range(dp)]).sum(0)
                / dp
                for e in entries
            }
        )
    return {name: param.detach() for name, param in params}


UP, DOWN = "tp1xdp4-to-tp2xdp2", "tp2xdp2-to-tp1xdp4"
CASES = [
    ("muon", "dcp", UP, "canzona", "fp32"),
    ("shampoo", "dcp", UP, "canzona", "fp32"),
    ("soap", "dcp", UP, "canzona", "fp32"),
    ("soap", "memory", UP, "canzona", "fp32"),
    ("shampoo", "dcp", DOWN, "canzona", "fp32"),
    ("soap", "dcp", UP, "tp-sc-to-dp-sc", "fp32"),
    ("shampoo", "dcp", DOWN, "replicated-tp-update", "fp32"),
    ("muon", "dcp", UP, "canzona", "bf16"),
    ("muon", "memory", DOWN, "canzona", "bf16"),
]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("optimizer", "via", "move", "strategy", "dtype"), CASES)
def test_training_continues_exactly_under_another_schedule(
    optimizer: str, via: str, move: str, strategy: str, dtype: str, tmp_path: Path
) -> None:
    """bf16 parameters: fp32 main copies move with the state (new vocab padding rows start from
    the parameters), so the result equals the reference's within one bf16 step."""
    settings = SETTINGS[optimizer]
    layouts = [
        make_schedule(MODEL, 1, 4, optimizer=optimizer, alpha=0.0, dtype=dtype, **settings),
        make_schedule(
            MODEL,
            2,
            2,
            optimizer=optimizer,
            alpha=1.0,
            bucket_size=3000,
            group_bytes=6144,
            dtype=dtype,
            tp_update="replicated" if strategy == "replicated-tp-update" else "auto",
            **settings,
        ),
    ]
    first, second = layouts if move.startswith("tp1") else layouts[::-1]
    report = reshard_report(first, second)
    assert report.compatible and len(report.notes) == 2, report.notes  # embedding and output: 384 <-> 512 rows
    folder = str(tmp_path / "checkpoint") if via != "memory" else None
    # a replicated TP update is canzona's own optimizer running the schedule's update
    strategies = ("tp-sc", "dp-sc") if strategy == "tp-sc-to-dp-sc" else ("canzona", "canzona")
    # all_to_all sums the DP 4 gradients in rank order, as the reference does: the comparison is
    # exact, so it checks the resharding alone. The backend's order (rooted, the default) on these
    # ill-conditioned Shampoo/SOAP settings moves results by up to 4e-3 / O(1) (benchmarks/numerics.py).
    results = run_ranks(
        _reshard_worker, 4, first, second, folder, {**HP, "dp_collectives": "all_to_all"}, strategies, via
    )
    dp_per_step = [first.request.dp] * K + [second.request.dp] * M
    reference = reference_run(make_schedule(MODEL, 1, 1, optimizer=optimizer, dtype=dtype, **settings), dp_per_step, HP)
    tp = second.request.tp
    rtol, atol = (1e-5, 1e-6) if dtype == "fp32" else (2**-7, 0.0)
    for rank, shards in enumerate(results):
        for entry in ordered(second):
            # Rows 384..511 exist only under TP 2: zero, without gradient or state, they stay zero.
            expected = shard(to_gathered(entry, _rows(reference[entry.name], entry.shape[0]), tp), entry, rank % tp, tp)
            torch.testing.assert_close(
                shards[entry.name],
                expected.to(shards[entry.name].dtype),
                rtol=rtol,
                atol=atol,
                msg=labelled(f"rank {rank} {entry.name}"),
            )


def _same_schedule_worker(rank: int, world: int, schedule: Schedule, folder: str, hp: dict[str, Any]) -> dict[str, Any]:
    dp_group, tp_group = make_groups(schedule.request.dp, schedule.request.tp)
    tp_rank = rank % schedule.request.tp
    straight = _local_params(schedule, {e.name: canonical_init(e) for e in schedule.params}, tp_rank)
    optimizer = CanzonaOptimizer(straight, schedule, dp_group=dp_group, tp_group=tp_group, **hp)
    _train(optimizer, schedule, straight, range(K + M))
    resumed = _local_params(schedule, {e.name: canonical_init(e) for e in schedule.params}, tp_rank)
    first = CanzonaOptimizer(resumed, schedule, dp_group=dp_group, tp_group=tp_group, **hp)
    _train(first, schedule, resumed, range(K))
    saved = first.state_dict()
    save_checkpoint(first, folder)
    second = CanzonaOptimizer(resumed, schedule, dp_group=dp_group, tp_group=tp_group, **hp)
    load_checkpoint(second, folder)
    loaded = second.state_dict()
    _train(second, schedule, resumed, range(K, K + M))
    return {
        "straight": {name: p.detach().clone() for name, p in straight},
        "resumed": {name: p.detach().clone() for name, p in resumed},
        "saved": {key: [data for _, data in t.chunks] for key, t in saved["tensors"].items()},
        "loaded": {key: [data for _, data in t.chunks] for key, t in loaded["tensors"].items()},
        "final": {key: [data for _, data in t.chunks] for key, t in optimizer.state_dict()["tensors"].items()},
        "final_resumed": {key: [data for _, data in t.chunks] for key, t in second.state_dict()["tensors"].items()},
    }


def _assert_equal(left: dict[str, Any], right: dict[str, Any], what: str) -> None:
    assert left.keys() == right.keys(), what
    for key in left:
        pairs = zip(left[key], right[key]) if isinstance(left[key], list) else [(left[key], right[key])]
        for a, b in pairs:
            assert torch.equal(a, b), f"{what}: {key} differs"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("optimizer", ["shampoo", "soap"])
def test_save_and_load_under_the_same_schedule_is_bit_exact(optimizer: str, tmp_path: Path) -> None:
    schedule = make_schedule(MODEL, 2, 2, optimizer=optimizer, **SETTINGS[optimizer])
    results = run_ranks(_same_schedule_worker, 4, schedule, str(tmp_path / "checkpoint"), HP)
    for rank, result in enumerate(results):
        _assert_equal(result["saved"], result["loaded"], f"rank {rank}: state after load")
        _assert_equal(result["straight"], result["resumed"], f"rank {rank}: parameters after {K + M} steps")
        _assert_equal(result["final"], result["final_resumed"], f"rank {rank}: state after {K + M} steps")


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("optimizer", "dtype"), [("muon", "fp32"), ("soap", "fp32"), ("muon", "bf16")])
def test_a_dcp_stateful_checkpoint_moves_between_schedules_of_one_shape(
    optimizer: str, dtype: str, tmp_path: Path
) -> None:
    """`dcp.save` / `dcp.load` of a `DcpState` (what torchtitan's checkpointer does): under another
    α and bucket size every matrix has another DP owner, and training goes on as the reference.
    DCP's own load planner refuses a logical tensor whose size changed (vocab padding at another
    TP size), which `load_checkpoint` reads across, so the layouts share TP 2 here."""
    settings = SETTINGS[optimizer]
    first = make_schedule(MODEL, 2, 2, optimizer=optimizer, alpha=0.0, dtype=dtype, **settings)
    second = make_schedule(
        MODEL, 2, 2, optimizer=optimizer, alpha=1.0, bucket_size=3000, group_bytes=6144, dtype=dtype, **settings
    )
    assert {e.name: e.owner for e in first.params} != {e.name: e.owner for e in second.params}
    results = run_ranks(
        _reshard_worker,
        4,
        first,
        second,
        str(tmp_path / "dcp"),
        {**HP, "dp_collectives": "all_to_all"},
        ("canzona", "canzona"),
        "stateful",
    )
    reference = reference_run(
        make_schedule(MODEL, 1, 1, optimizer=optimizer, dtype=dtype, **settings), [2] * (K + M), HP
    )
    rtol, atol = (1e-5, 1e-6) if dtype == "fp32" else (2**-7, 0.0)
    for rank, shards in enumerate(results):
        for entry in ordered(second):
            expected = shard(to_gathered(entry, _rows(reference[entry.name], entry.shape[0]), 2), entry, rank % 2, 2)
            torch.testing.assert_close(
                shards[entry.name],
                expected.to(shards[entry.name].dtype),
                rtol=rtol,
                atol=atol,
                msg=labelled(f"rank {rank} {entry.name}"),
            )
