"""Predict one optimizer step, and one training iteration, of a schedule and of every baseline
on a hardware model.

A step runs from unreduced gradients to updated parameters on every device: DP collectives
before (gradient reductions per bucket, spill-over fetches), a local stage per device (TP
collectives, matrix updates, AdamW), DP collectives after (broadcasts, parameter gathers per
bucket). DP collectives synchronise their group, so, with nothing overlapped,

    step = Σ before + max over devices of the local stage + Σ after.

Collectives are priced by the α–β model of `canzona.planner.partition.collectives`, per bucket in
bucket order, as the runtime issues them (each matrix bucket in the form its schedule records:
padded ring, rooted reduces/broadcasts, or all-to-all). A group whose
ranks span nodes uses the inter-node bandwidth, otherwise the intra-node one. Gradients move
in fp32 (Megatron's main grads; the runtime's TP exchanges), parameters in their dtype.

Compute comes from a seconds cost model (`ThroughputCost`: flops model / achieved FLOP/s, or a
measured `ProfileCost`). The TP micro-group pipeline is simulated event by event, in the order
`MicroGroupPipeline.run` issues it. The step model is `canzona.planner.predict.step`; baselines
are in `canzona.planner.predict.sim_baselines`; the whole iteration (forward and backward, with
every strategy's DP collectives overlapped under the same settings, where it has such
collectives) in `canzona.planner.predict.iteration`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from canzona.planner.partition.costs import CostModel
from canzona.planner.plan import TrainingSetup
from canzona.planner.predict.hardware import Hardware
from canzona.planner.predict.iteration import IterationTime, iteration_times
from canzona.planner.predict.sim_baselines import baseline_times
from canzona.planner.predict.step import StrategyTime, build_instance, canzona_time, default_time_model
from canzona.schedules.costs import update_label, update_precision
from canzona.schedules.format import Schedule
from canzona.schedules.limits import AS_SCHEDULED


@dataclass(frozen=True)
class Simulation:
    """Every strategy's predicted step (canzona first) on one hardware model, and, when a
    training setup was given, every strategy's predicted iteration in the same order."""

    model: str
    tp: int
    dp: int
    ep: int
    optimizer: str
    hardware: Hardware
    time_model: str
    fused: bool
    dp_collectives: str
    strategies: tuple[StrategyTime, ...]
    training: TrainingSetup | None = None
    iterations: tuple[IterationTime, ...] = ()
    precision: str = "bf16"  # of the matrix products, as priced (`update_precision`)
    update: str = ""  # how the matrix updates run, in words (`update_label`)

    def get(self, name: str) -> StrategyTime:
        """The strategy called `name` (KeyError if absent)."""
        for strategy in self.strategies:
            if strategy.name == name:
                return strategy
        raise KeyError(name)

    def iteration(self, name: str) -> IterationTime:
        """The iteration of the strategy called `name` (KeyError if absent or not predicted)."""
        for it in self.iterations:
            if it.name == name:
                return it
        raise KeyError(name)

    def ratios(self) -> dict[str, float]:
        """Each strategy's step time over canzona's."""
        base = self.get("canzona").step
        return {s.name: (s.step / base if base else 1.0) for s in self.strategies}

    def iteration_ratios(self) -> dict[str, float]:
        """Each strategy's iteration time over canzona's (empty without a training setup)."""
        if not self.iterations:
            return {}
        base = self.iteration("canzona").iteration
        return {it.name: it.iteration / base for it in self.iterations}


def simulate(
    schedule: Schedule,
    hardware: Hardware,
    time_model: CostModel | None = None,
    *,
    fused: bool = False,
    publish_bytes: int | None = None,
    dp_collectives: str = AS_SCHEDULED,
    training: TrainingSetup | None = None,
    overlap_grad_reduce: bool = True,
    overlap_param_gather: bool = False,
    routed_fraction: float | None = None,
) -> Simulation:
    """Predict one optimizer step of the schedule and of every baseline on `hardware`, and with
    a `training` setup also one training iteration of each.

    `time_model` prices compute in seconds (default: the flops model at the hardware's
    throughput). `fused`: every buffer moves in one collective instead of one per bucket.
    `publish_bytes`: element size of the parameter all-gather (default: the parameters'
    dtype; the CPU runtime gathers fp32). `dp_collectives`: each matrix bucket's collective as
    the schedule records it ("schedule", the runtime's default), or one of
    `BUCKET_COLLECTIVES` for every bucket (the runtime's `dp_collectives=`).
    `overlap_grad_reduce` and `overlap_param_gather`: the runtime's options, applied alike to
    every strategy that has such collectives (Megatron's `--overlap-grad-reduce` and
    `--overlap-param-gather` for the baselines). `routed_fraction`: MoE top-k / experts
    (default: from the model's preset or config)."""
    model = time_model or default_time_model(schedule, hardware)
    inst = build_instance(
        schedule, hardware, model, fused, publish_bytes, dp_collectives, overlap_grad_reduce, overlap_param_gather
    )
    strategies = (canzona_time(inst, schedule), canzona_time(inst, schedule, overlap=False), *baseline_times(inst))
    iterations: tuple[IterationTime, ...] = ()
    if training is not None:
        iterations = iteration_times(schedule, hardware, training, strategies, fused, routed_fraction)
    req = schedule.request
    return Simulation(
        req.model.name,
        req.tp,
        req.dp,
        req.ep,
        req.optimizer.name,
        hardware,
        getattr(model, "name", "seconds"),
        fused,
        dp_collectives,
        strategies,
        training,
        iterations,
        update_precision(req.optimizer, hardware.gpu),
        update_label(req.optimizer, hardware.gpu),
    )


def predicted_ratios(
    schedule: Schedule,
    hardware: Hardware,
    time_model: CostModel | None = None,
    *,
    fused: bool = True,
    publish_bytes: int | None = 4,
    names: Sequence[str] = ("canzona", "dp-sc", "tp-sc"),
) -> dict[str, float]:
    """Predicted step seconds of `names` with a runtime's execution choices (here: one fused
    DP exchange, fp32 parameter all-gather): the simulator side of the CPU cross-check."""
    sim = simulate(schedule, hardware, time_model, fused=fused, publish_bytes=publish_bytes)
    return {name: sim.get(name).step for name in names}
