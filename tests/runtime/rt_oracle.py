"""The clean oracle: deterministic full parameters and per-DP-rank gradients (seeded), a
distributed worker that trains the TP shards with a runtime optimizer, and the single-process
reference on the full tensors with the DP-mean gradients."""

from __future__ import annotations

import zlib
from typing import Any

import torch

from canzona.runtime import CanzonaOptimizer, DpScOptimizer, TpScOptimizer
from canzona.runtime.reference import ReferenceOptimizer
from canzona.runtime.schedule import DTYPES
from canzona.schedules.format import ParamEntry, Schedule

from rt_harness import make_groups

STRATEGIES = {"canzona": CanzonaOptimizer, "tp-sc": TpScOptimizer, "dp-sc": DpScOptimizer}


def _generator(*key: Any) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def full_params(schedule: Schedule) -> dict[str, torch.Tensor]:
    """Full (gathered-layout) initial values of every parameter, in its schedule dtype."""
    return {e.name: (torch.randn(e.shape, generator=_generator("init", e.name)) * 0.1).to(DTYPES[e.dtype]) for e in schedule.params}


def full_grad(entry: ParamEntry, step: int, dp_rank: int) -> torch.Tensor:
    """DP rank `dp_rank`'s full gradient of `entry` at `step` (a shared part plus a per-rank
    part), in the parameter's dtype."""
    shared = torch.randn(entry.shape, generator=_generator("grad", entry.name, step))
    own = torch.randn(entry.shape, generator=_generator("noise", entry.name, step, dp_rank))
    return (shared + 0.5 * own).to(DTYPES[entry.dtype])


def shard(full: torch.Tensor, entry: ParamEntry, tp_rank: int, tp: int) -> torch.Tensor:
    """TP rank `tp_rank`'s shard of a full tensor."""
    return full if entry.tp_dim is None else full.chunk(tp, dim=entry.tp_dim)[tp_rank].contiguous()


def ordered(schedule: Schedule) -> list[ParamEntry]:
    """The schedule's parameters in registration order."""
    return sorted(schedule.params, key=lambda e: e.index)


def train_worker(rank: int, world: int, schedules: list[Schedule], steps: int, strategy: str, hp: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
    """Train the shards of every schedule in turn on this rank; each schedule's final shards."""
    out = []
    for schedule in schedules:
        dp, tp = schedule.request.dp, schedule.request.tp
        assert world == dp * tp
        dp_rank, tp_rank = divmod(rank, tp)
        dp_group, tp_group = make_groups(dp, tp)
        full = full_params(schedule)
        entries = ordered(schedule)
        params = [(e.name, torch.nn.Parameter(shard(full[e.name], e, tp_rank, tp))) for e in entries]
        optimizer = STRATEGIES[strategy](params, schedule, dp_group=dp_group, tp_group=tp_group, **hp)
        for step in range(steps):
            for entry, (_, param) in zip(entries, params):
                param.grad = shard(full_grad(entry, step, dp_rank), entry, tp_rank, tp)
            optimizer.step()
            optimizer.zero_grad()
        out.append({name: param.detach().clone() for name, param in params})
    return out


def reference_run(schedule: Schedule, steps: int, hp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The reference optimizer on the full tensors with the DP-mean gradients (in fp32, as
    the runtime reduces them)."""
    dp = schedule.request.dp
    full = full_params(schedule)
    entries = ordered(schedule)
    params = [(e.name, torch.nn.Parameter(full[e.name].clone())) for e in entries]
    optimizer = ReferenceOptimizer(params, schedule, **hp)
    for step in range(steps):
        grads = {e.name: torch.stack([full_grad(e, step, d).float() for d in range(dp)]).sum(0) / dp for e in entries}
        optimizer.step(grads)
    return {name: param.detach() for name, param in params}


def compare(schedule: Schedule, results: list[dict[str, torch.Tensor]], reference: dict[str, torch.Tensor],
            rtol: float | None = 1e-5, atol: float | None = 1e-6) -> None:
    """Every rank's every shard equals the reference's shard of the same parameter."""
    tp = schedule.request.tp
    for rank, shards in enumerate(results):
        tp_rank = rank % tp
        for entry in ordered(schedule):
            expected = shard(reference[entry.name], entry, tp_rank, tp)
            got = shards[entry.name]
            torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=lambda m: f"rank {rank} {entry.name}: {m}")
