"""Predict one whole training iteration: forward and backward of every micro-batch, with each
strategy's DP collectives overlapped as it runs them, then its optimizer stage.

Compute. Training FLOPs ≈ 6 · parameters · tokens (2 forward, 4 backward), per device: its
local parameters (TP shards; under expert parallelism its EP rank's experts, each visited by
ep · top_k / experts of its DP rank's tokens) times its DP rank's tokens, at the hardware's
achieved training FLOP/s. Embedding lookups count like matmuls and attention scores are left
out (the usual 6·N convention).

Timeline, in steady state (the contract the runtime implements):

- Micro-batches run forward then backward; only the last one's backward launches gradient
  reductions (gradient accumulation suppresses the others).
- Backward produces gradients in reverse registration order, spread over parameters in
  proportion to their FLOPs. A bucket is ready when backward has produced the gradient of its
  first-registered parameter. Reductions run on one communication queue, launched in order of
  readiness (within a buffer: bucket order): bucket b starts at max(ready_b, end of the
  previous reduction). Without gradient overlap they start when backward ends.
- The optimizer stage (fetches, local stage, publishing broadcasts) starts when every
  reduction has finished.
- Parameter gathers follow. Without gather overlap they all finish before the next forward;
  with it they are launched first-needed first and the next first forward waits, module by
  module, for the bucket holding its first-registered parameter.

    iteration = M · (forward + backward) + exposed reductions + optimizer stage + exposed gathers
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from canzona.planner.partition.collectives import phase_seconds
from canzona.planner.predict.hardware import Hardware
from canzona.planner.predict.step import ADAMW_BUFFER, DENSE, EXPERT, BucketSync, StrategyTime
from canzona.planner.request import PlanRequest, TrainingSetup
from canzona.planner.sources.architecture import Architecture
from canzona.planner.sources.catalog import PRESETS
from canzona.planner.sources.hf_config import architecture_from_hf
from canzona.planner.sources.param_file import read_structured_file
from canzona.planner.spec import PlanError
from canzona.schedules.format import ParamEntry, Schedule
from canzona.schedules.limits import MATRIX

BufferKey = tuple[str, int]  # (buffer, bucket index)
BUFFER_ORDER = {DENSE: 0, EXPERT: 1, ADAMW_BUFFER: 2}
FORWARD_SHARE, BACKWARD_SHARE = 2.0, 4.0  # of the 6 FLOPs per parameter and token


@dataclass(frozen=True)
class DeviceCompute:
    """Forward and backward of one micro-batch on one device, and where each bucket falls in
    them: `ready` = fraction of backward done when the bucket's last gradient exists,
    `needed` = fraction of forward done when the bucket is first used."""

    forward: float
    backward: float
    micro_batches: int
    tokens_per_micro_batch: float
    flops_per_micro_batch: float
    ready: dict[BufferKey, float]
    needed: dict[BufferKey, float]


@dataclass(frozen=True)
class IterationTime:
    """One strategy's predicted iteration: `forward_backward` (every micro-batch's compute,
    the same for every strategy), the reductions and gathers left exposed by the overlap, and
    the optimizer stage nothing overlaps (fetches, local stage, publishing broadcasts)."""

    name: str
    iteration: float
    forward_backward: float
    exposed_reduce: float
    optimizer: float
    exposed_gather: float
    overlap_grad: bool
    overlap_param: bool


# --------------------------------------------------------------------------------------------
# Which parameters are MoE experts, and how many tokens visit them


def source_architecture(source: str) -> Architecture | None:
    """The architecture of a preset name or Hugging Face config.json (None for anything else,
    e.g. a parameter-list file, or a file that is not there)."""
    preset = source.strip().lower()
    if preset in PRESETS:
        return PRESETS[preset]
    path = Path(source)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix.lower() != ".json" or not path.is_file():
        return None
    try:
        data: Any = read_structured_file(path)[0]
        if isinstance(data, dict) and ("architectures" in data or "model_type" in data):
            return architecture_from_hf(data)
    except PlanError:
        return None
    return None


def expert_indices(schedule: Schedule) -> frozenset[int]:
    """Registration indices of the expert parameters one device holds: under expert
    parallelism the ones the schedule marks for EP rank 0; else the model's own (when its
    source can be read again), otherwise none."""
    if schedule.request.ep > 1:
        return frozenset(e.index for e in schedule.params if e.ep_rank == 0)
    grouped = frozenset(e.index for e in schedule.params if e.param is not None)
    if grouped:  # expert slices of grouped 3-D tensors say so themselves
        return grouped
    from canzona.planner.sources.load import load_model

    req = schedule.request
    try:
        model = load_model(req.model.source, req.tp, PlanRequest.from_request(req).options)
    except PlanError:
        return frozenset()
    names = {e.name for e in schedule.params}
    return frozenset(i for i, p in enumerate(model.params) if p.expert_index is not None and p.name in names)


def check_routed_fraction(routed_fraction: float) -> None:
    """PlanError unless `routed_fraction` (top_k / num_experts) is in (0, 1]."""
    if not 0 < routed_fraction <= 1:
        raise PlanError(f"routed fraction must be in (0, 1], got {routed_fraction}")


def routing(schedule: Schedule, routed_fraction: float | None) -> tuple[float, frozenset[int]]:
    """(share of a layer's experts each token visits, expert parameters on one device)."""
    if routed_fraction is not None:
        check_routed_fraction(routed_fraction)
    arch = source_architecture(schedule.request.model.source)
    moe = (arch is not None and arch.num_experts > 0) or any(e.param is not None for e in schedule.params)
    if schedule.request.ep == 1 and not moe and routed_fraction is None:
        return 1.0, frozenset()
    experts = expert_indices(schedule)
    if not experts:
        return 1.0, experts
    if routed_fraction is not None:
        return routed_fraction, experts
    if arch is None or not moe:
        raise PlanError(
            f"cannot tell how many experts a token visits in {schedule.request.model.name!r}: "
            "give --routed-fraction (top_k / num_experts)"
        )
    return arch.top_k / arch.num_experts, experts


# --------------------------------------------------------------------------------------------
# Forward and backward of one device


def _buffer_key(entry: ParamEntry) -> BufferKey:
    if entry.optimizer != MATRIX:
        return ADAMW_BUFFER, entry.bucket
    return (EXPERT if entry.ep_rank is not None else DENSE), entry.bucket


def device_compute(
    schedule: Schedule, hardware: Hardware, training: TrainingSetup, routed_fraction: float | None = None
) -> DeviceCompute:
    """Forward and backward seconds of one micro-batch on one device, and each bucket's
    position in them (see the module docstring)."""
    req = schedule.request
    micro_batches = training.validate(req.dp)
    fraction, experts = routing(schedule, routed_fraction)
    weights: list[tuple[int, BufferKey, float]] = []
    for entry in schedule.params:
        if entry.ep_rank not in (None, 0):
            continue  # another EP rank's experts: not on this device
        share = req.ep * fraction if entry.index in experts else 1.0
        weights.append((entry.index, _buffer_key(entry), entry.numel * share))
    weights.sort(key=lambda item: item[0])
    total = sum(w for _, _, w in weights)
    first: dict[BufferKey, int] = {}
    before: list[float] = []  # FLOP weight registered before each parameter
    running = 0.0
    for position, (_, key, weight) in enumerate(weights):
        first.setdefault(key, position)
        before.append(running)
        running += weight
    scale = 1.0 / total if total else 0.0
    needed = {key: before[position] * scale for key, position in first.items()}
    ready = {key: 1.0 - value for key, value in needed.items()}
    tokens = training.global_batch * training.seq_len / (req.dp * micro_batches)
    flops = 6.0 * total * tokens
    rate = hardware.training_flops()
    return DeviceCompute(
        forward=flops * FORWARD_SHARE / 6.0 / rate,
        backward=flops * BACKWARD_SHARE / 6.0 / rate,
        micro_batches=micro_batches,
        tokens_per_micro_batch=tokens,
        flops_per_micro_batch=flops,
        ready=ready,
        needed=needed,
    )


# --------------------------------------------------------------------------------------------
# The overlapped timeline


def reduce_tail(units: Sequence[tuple[float, float]], backward: float, overlap: bool) -> float:
    """Seconds from the start of the last backward to the end of the last reduction (at least
    the backward). `units`: (ready fraction, seconds) per reduction, in launch order."""
    if not overlap:
        return backward + sum(seconds for _, seconds in units)
    clock = 0.0
    for ready, seconds in units:
        clock = max(clock, ready * backward) + seconds
    return max(backward, clock)


def gather_head(units: Sequence[tuple[float, float]], forward: float, overlap: bool) -> float:
    """Seconds from the launch of the first gather to the end of the next first forward.
    `units`: (needed fraction, seconds) per gather, in launch order (first needed first)."""
    if not overlap:
        return sum(seconds for _, seconds in units) + forward
    comm = clock = position = 0.0
    for needed, seconds in units:
        comm += seconds
        clock = max(clock + (needed - position) * forward, comm)
        position = max(position, needed)
    return clock + (1.0 - position) * forward


def _units(
    syncs: Sequence[BucketSync], where: dict[BufferKey, float], fused: bool, fallback: float, latest: bool = False
) -> list[tuple[float, float]]:
    """(position, seconds) per collective, sorted by position (then buffer and bucket order);
    `fused`: one collective for all of them, at the earliest position (`latest`: the latest)."""
    if not syncs:
        return []
    if fused:
        positions = [where.get((s.buffer, s.bucket), fallback) for s in syncs]
        return [(max(positions) if latest else min(positions), phase_seconds([s.exchange for s in syncs], True))]
    keyed = sorted(syncs, key=lambda s: (where.get((s.buffer, s.bucket), fallback), BUFFER_ORDER[s.buffer], s.bucket))
    return [(where.get((s.buffer, s.bucket), fallback), s.exchange.seconds()) for s in keyed]


def iteration_time(strategy: StrategyTime, compute: DeviceCompute, fused: bool = False) -> IterationTime:
    """One strategy's iteration from its step's DP collectives and the device's compute."""
    phases = strategy.phases
    reduce_units = _units(phases.reduce, compute.ready, fused, 1.0, latest=True)
    gather_units = _units(phases.gather, compute.needed, fused, 0.0)
    tail = reduce_tail(reduce_units, compute.backward, phases.overlap_grad)
    head = gather_head(gather_units, compute.forward, phases.overlap_param)
    optimizer = phase_seconds(phases.fetch, fused) + strategy.optimizer_stage + phase_seconds(phases.publish, fused)
    forward_backward = compute.micro_batches * (compute.forward + compute.backward)
    exposed_reduce, exposed_gather = tail - compute.backward, head - compute.forward
    return IterationTime(
        name=strategy.name,
        iteration=forward_backward + exposed_reduce + optimizer + exposed_gather,
        forward_backward=forward_backward,
        exposed_reduce=exposed_reduce,
        optimizer=optimizer,
        exposed_gather=exposed_gather,
        overlap_grad=phases.overlap_grad,
        overlap_param=phases.overlap_param,
    )


def iteration_times(
    schedule: Schedule,
    hardware: Hardware,
    training: TrainingSetup,
    strategies: Sequence[StrategyTime],
    fused: bool = False,
    routed_fraction: float | None = None,
) -> tuple[IterationTime, ...]:
    """Every strategy's iteration, in the order given."""
    compute = device_compute(schedule, hardware, training, routed_fraction)
    return tuple(iteration_time(strategy, compute, fused) for strategy in strategies)
