"""What `plan` and `show` lead with: a schedule's predicted optimizer step, what bounds it, and
how far it is above a lower bound of the step.

The step is canzona's as the simulator predicts it (`canzona_time`: DP reductions, the critical
device's local stage, DP gathers) on the reference device (`objective.REFERENCE_DEVICE`, or the
built-in device an automatic search chose on). It is bound by communication when its exposed
communication (step − the critical device's compute) is the larger part, else by compute; its
largest part names the collective: a matrix buffer's buckets in one collective form (reduce
plus gather), the AdamW buffer's, or the critical device's local stage.

The lower bound holds for every plan of the schedule's buckets on that device:

- each matrix bucket of n ranks: whatever its cuts, some rank sends (and some receives) at
  least the bucket less an equal slice, (n − 1)/n of it, once as fp32 gradients and once as
  parameters, with at least one α each way (every form the runtime has moves that much); the
  expert buffers of the EP ranks travel at once, over their own groups: one counts;
- the AdamW buffer's equal reduce-scatter and all-gather, which every plan runs alike;
- the local stage: the busiest device does at least the mean of all matrix updates over
  the tp x dp devices, and at least 1/tp of the largest one (a team of tp hosts shares it at
  best), plus the least AdamW of any device.
"""

from __future__ import annotations

from dataclasses import dataclass

from canzona.planner.partition.collectives import GRAD_BYTES
from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.predict.hardware import BUILTIN, Device
from canzona.planner.predict.objective import REFERENCE_DEVICE, search_device
from canzona.planner.predict.step import Buffer, Instance, adamw_sync, build_instance, canzona_parts
from canzona.schedules.format import Schedule
from canzona.schedules.limits import AS_SCHEDULED
from canzona.schedules.models import Request

LOCAL_STAGE = "local stage"  # the part of the step that is the critical device's own


@dataclass(frozen=True)
class StepHeadline:
    """A schedule's predicted step on `device`: its seconds, the critical device's compute, what
    bounds it ("compute" or "communication"), its largest part (`top`, seconds `top_s`) and a
    lower bound of the step (see the module docstring)."""

    device: str
    step_s: float
    compute_s: float
    bound: str
    top: str
    top_s: float
    lower_bound_s: float

    @property
    def over_bound(self) -> float:
        """The step over its lower bound (1.0: at the bound)."""
        return self.step_s / self.lower_bound_s if self.lower_bound_s > 0 else 1.0


def headline_device(request: Request) -> Device:
    """The device a schedule's headline is predicted on: the built-in device its search ran on,
    else the reference (never a file a schedule names: schedules are untrusted input)."""
    name = request.alpha_device or request.bucket_device or REFERENCE_DEVICE
    return search_device(name if name in BUILTIN else REFERENCE_DEVICE, request.tp * request.dp)


def step_headline(schedule: Schedule) -> StepHeadline:
    """The headline of a replicated (non-FSDP) schedule (see the module docstring)."""
    device = headline_device(schedule.request)
    opt = schedule.request.optimizer
    config = OptimizerConfig(**opt.model_dump())
    instance = build_instance(
        schedule, device.hardware, device.time_model(config), False, None, AS_SCHEDULED, True, False
    )
    parts, local = canzona_parts(instance, schedule)
    parts[LOCAL_STAGE] = max(local.seconds, 0.0)
    step, compute = sum(parts.values()), max(max(local.compute), 0.0)
    top = max(parts, key=lambda key: (parts[key], key))
    bound = "communication" if step - compute > compute else "compute"
    return StepHeadline(device.hardware.name, step, compute, bound, top, parts[top], _lower_bound(instance))


def _bucket_bound(buffer: Buffer, instance: Instance) -> float:
    """The least seconds any cuts of the buffer's buckets reduce and gather them in."""
    link, seconds = buffer.link, 0.0
    if link.size <= 1:
        return 0.0
    for numel, param_bytes in zip(buffer.numel, buffer.param_bytes):
        if numel > 0:
            moved = numel * (link.size - 1) / link.size * (GRAD_BYTES + instance.gather_bytes(param_bytes))
            seconds += 2 * link.latency + moved / link.bandwidth
    return seconds


def _lower_bound(instance: Instance) -> float:
    """A lower bound of the step of any plan of these buckets (see the module docstring)."""
    comm = sum(_bucket_bound(buffer, instance) for buffer in (instance.dense, *instance.experts[:1]))
    comm += sum(s.exchange.seconds() for gather in (False, True) for s in adamw_sync(instance, gather))
    seconds = [matrix.seconds for matrix in instance.matrices.values()]
    devices = instance.tp * instance.dp
    updates = max(sum(seconds) / devices, max(seconds, default=0.0) / instance.tp)
    adamw = min(instance.time_model.adamw_cost(instance.adamw_elements(rank)) for rank in range(instance.dp))
    return comm + updates + adamw
