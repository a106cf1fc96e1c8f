"""Predict the optimizer step of an FSDP schedule (`--fsdp`) and of its baselines.

FSDP2's own all-gathers and reduce-scatters are the same whatever the optimizer, so only the
optimizer step is priced, from FSDP2's reduce-scattered gradients to updated shards:

- `canzona`: per micro-group, the gather all-to-all of the pieces to their hosts, the busiest
  host's updates and the scatter all-to-all of the update pieces, pipelined as `FsdpOptimizer`
  issues them (`step.pipeline_seconds`: the next gather in flight), then AdamW on the shards;
- `canzona (no overlap)`: the same groups one after another;
- `redundant`: every device all-gathers every matrix and updates all of them (the usual FSDP2
  Muon), then AdamW on the shards;
- `adamw`: AdamW on every shard, matrices included (the element-wise floor).

Collectives are priced by the α–β model of `collectives.py` on the fragmentation group's link
(inter-node bandwidth when its devices span nodes); pieces follow `canzona.schedules.fsdp`.
"""

from __future__ import annotations

from dataclasses import dataclass

from canzona.planner.partition.collectives import GRAD_BYTES, Exchange, Link, all_gather, group_link
from canzona.planner.partition.costs import CostModel
from canzona.planner.predict.hardware import Hardware
from canzona.planner.predict.step import GroupTimes, default_time_model, entry_seconds, pipeline_seconds
from canzona.schedules.format import ParamEntry, Schedule
from canzona.schedules.fsdp import FsdpLayout, sends_to_host, shard_numel
from canzona.schedules.limits import MATRIX


@dataclass(frozen=True)
class FsdpStrategy:
    """One strategy's predicted optimizer step (seconds) and what it is."""

    name: str
    step: float
    description: str


@dataclass(frozen=True)
class FsdpSimulation:
    """The predicted step of an FSDP schedule and of its baselines on one hardware model."""

    model: str
    tp: int
    dp: int
    dp_replicate: int
    optimizer: str
    hardware: Hardware
    num_groups: int
    strategies: tuple[FsdpStrategy, ...]

    def get(self, name: str) -> FsdpStrategy:
        """The strategy called `name`."""
        return next(s for s in self.strategies if s.name == name)


def _exchange(pieces: list[tuple[int, int, int]], link: Link, hosts: int) -> Exchange:
    """An all-to-all moving (sender, receiver, elements) pieces; self-sends are free."""
    sent, received = [0.0] * hosts, [0.0] * hosts
    for sender, receiver, numel in pieces:
        if sender != receiver:
            sent[sender] += GRAD_BYTES * numel
            received[receiver] += GRAD_BYTES * numel
    return Exchange("all-to-all", link, tuple(sent), tuple(received))


def _group_times(
    entries: list[tuple[ParamEntry, int]], layout: FsdpLayout, link: Link, time_model: CostModel
) -> GroupTimes:
    gather, scatter, loads = [], [], [0.0] * layout.hosts
    for entry, host in entries:
        loads[host] += entry_seconds(entry, time_model)
        for fragment in range(layout.hosts):
            numel = shard_numel(entry.shape, entry.tp_dim, layout, fragment)
            if sends_to_host(entry.tp_dim, fragment, host, layout.tp):
                gather.append((fragment, host, numel))
            scatter.append((host, fragment, numel))
    return GroupTimes(
        _exchange(gather, link, layout.hosts).seconds(), max(loads), _exchange(scatter, link, layout.hosts).seconds()
    )


def simulate_fsdp(schedule: Schedule, hardware: Hardware, time_model: CostModel | None = None) -> FsdpSimulation:
    """Predict one optimizer step of an FSDP schedule and of its baselines on `hardware`."""
    model = time_model or default_time_model(schedule, hardware)
    layout = FsdpLayout.of(schedule.request.tp, schedule.request.dp, schedule.request.dp_replicate)
    link = group_link(hardware.network, "fsdp", range(layout.hosts))
    entries = {e.name: e for e in schedule.params}
    groups = [
        _group_times([(entries[n], h) for n, h in zip(g.params, g.hosts)], layout, link, model)
        for g in schedule.tp.ranks[0].groups
    ]
    matrices = [e for e in schedule.params if e.optimizer == MATRIX]
    others = [e for e in schedule.params if e.optimizer != MATRIX]

    def adamw(params: list[ParamEntry]) -> float:
        busiest = max(sum(shard_numel(e.shape, e.tp_dim, layout, f) for e in params) for f in range(layout.hosts))
        return model.adamw_cost(busiest) if busiest else 0.0

    def gathered(entry: ParamEntry) -> float:
        """`full_tensor()` of one gradient: over every device, or over the shards only for a
        matrix replicated over TP."""
        over = range(layout.hosts) if entry.tp_dim is not None else range(0, layout.hosts, layout.tp)
        pieces = [shard_numel(entry.shape, entry.tp_dim, layout, f) for f in over]
        return all_gather(Link(link.name, len(pieces), link.bandwidth, link.latency), pieces, GRAD_BYTES).seconds()

    redundant = sum(gathered(e) + entry_seconds(e, model) for e in matrices) + adamw(others)
    req = schedule.request
    strategies = (
        FsdpStrategy(
            "canzona",
            pipeline_seconds(groups) + adamw(others),
            "micro-groups over DP shard x TP, next gather in flight",
        ),
        FsdpStrategy(
            "canzona (no overlap)",
            pipeline_seconds(groups, overlap=False) + adamw(others),
            "the same micro-groups one after another",
        ),
        FsdpStrategy("redundant", redundant, "every device gathers and updates every matrix"),
        FsdpStrategy("adamw", adamw(matrices + others), "AdamW on every shard (element-wise floor)"),
    )
    return FsdpSimulation(
        req.model.name, req.tp, req.dp, req.dp_replicate, req.optimizer.name, hardware, len(groups), strategies
    )
