"""The step engine: one rank's buffers, state and process groups, and the stages of a step.

A step is five named stages, run by `CanzonaOptimizer.step` in this order:

1. **reduce**: pack this rank's gradients into the bucket buffer and reduce every bucket over DP
   at the schedule's cuts, in place (started from backward with `overlap_grad_reduce`);
2. **agree**: one safe point where every rank learns whether any rank has a problem (a bad
   gradient, a failing pre-hook or closure, a bad hyperparameter), which entries have a
   gradient somewhere, which buckets changed after backward reduced them (reduced again), and
   whether main copies must be rebuilt. Nothing has changed yet: a problem fails the step on
   every rank, and the step may be retried;
3. **update micro-groups**: the TP micro-group pipeline (or TP-SC's replicated updates) updates
   the matrices this rank owns, in place;
4. **AdamW**: this rank's AdamW slices, in place; then a second safe point confirms that every
   rank's update succeeded (else every rank raises `StepFailedError`, and the optimizer
   refuses to step until a checkpoint is loaded: state already changed);
5. **publish**: the new values are gathered over DP, bucket by bucket, into every rank's
   parameters (overlapped with the next forward with `overlap_param_gather`).

Memory (bf16 parameters, Muon): the fp32 bucket buffer (4 bytes per parameter, reused for the
gather), fp32 main copies and momentum of what this rank updates, AdamW moments of its slices,
and transients bounded by the micro-group capacity. No stage copies the optimizer state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime import binding
from canzona.runtime.exchange.buckets import DpComms
from canzona.runtime.exchange.gather import ParamGather
from canzona.runtime.exchange.gradients import global_norm
from canzona.runtime.exchange.pipeline import MicroGroupPipeline, TpGeometry, gather_replicated, replicated_updates
from canzona.runtime.exchange.reduction import GradSource, Round
from canzona.runtime.faults import CollectiveError, StepFailedError, fail_together, settle
from canzona.runtime.plan import RankPlan
from canzona.runtime.rules import cooperative, precision
from canzona.runtime.state.store import OptimizerState, fresh_state
from canzona.runtime.update import StepContext, Updater
from canzona.schedules.layout import Task

LOG = logging.getLogger("canzona")
HYPERPARAMETERS_DIFFER = (
    "the groups' hyperparameters (lr, weight decay, betas, momentum, eps, ...) differ across ranks: "
    "every rank must step with the same values, or replicas diverge"
)
SCALES_DIFFER = (
    "the loss scaler's scale differs across ranks (an overflow only some ranks saw changed theirs): use "
    "torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler and call scaler.unscale_(optimizer) "
    "before scaler.step(optimizer): it agrees overflows across ranks"
)


@dataclass(frozen=True)
class LossScaling:
    """What a loss scaler (`torch.amp.GradScaler`) hands a step: this rank's overflow flag and
    the scale to divide the gradients by (None when the script unscaled them already)."""

    found_inf: Tensor
    scale: Tensor | None


@dataclass(frozen=True)
class Agreed:
    """What the reduction's safe point settled: buckets to reduce again, which entries have a
    gradient on some rank, and whether a loss scaler saw an overflow on some rank."""

    redo: list[int]
    has_grad: list[bool]
    overflow: bool


def _scaling_flags(scaling: LossScaling | None, device: torch.device, digest: int = 0) -> dict[str, Tensor]:
    """The flags for a safe point: the hyperparameters' `digest` both ways (MAX of v and -v is
    the largest and the negated smallest: they match only if every rank's does); and the loss
    scaler's: any overflow, and the scale's bits both ways (a positive fp32's bits order like its
    value)."""
    flags = {
        "hp_max": torch.tensor(digest, dtype=torch.int32, device=device),
        "hp_min": torch.tensor(-digest, dtype=torch.int32, device=device),
    }
    if scaling is None:
        return flags
    flags["overflow"] = (scaling.found_inf.to(device) > 0).to(torch.int32)
    if scaling.scale is not None:
        bits = scaling.scale.to(device=device, dtype=torch.float32).reshape(1).view(torch.int32)
        flags.update(scale_max=bits, scale_min=-bits)
    return flags


def _disagreement(named: dict[str, int], scaling: LossScaling | None) -> str | None:
    """What the agreed flags show the ranks disagree on, if anything."""
    if named["hp_max"] != -named["hp_min"]:
        return HYPERPARAMETERS_DIFFER
    if scaling is not None and scaling.scale is not None and named["scale_max"] != -named["scale_min"]:
        return SCALES_DIFFER
    return None


@dataclass(frozen=True)
class Groups:
    """The process groups a rank's step runs over (expert-DP: None without expert parallelism)."""

    dp: dist.ProcessGroup
    tp: dist.ProcessGroup
    expert_dp: dist.ProcessGroup | None = None


def _global_ranks(group: dist.ProcessGroup | None) -> tuple[int, ...]:
    return () if group is None else tuple(dist.get_process_group_ranks(group))


class Engine:
    """One rank's step machinery over a frozen `RankPlan` (module docstring)."""

    def __init__(
        self, plan: RankPlan, groups: Groups, source: GradSource, dp_collectives: str, timeout: timedelta | None
    ) -> None:
        self.plan, self.groups, self.source, self.timeout = plan, groups, source, timeout
        # NCCL's Work.wait(timeout) blocks the host until the collective finishes, which would
        # serialise the pipeline: on CUDA the waits inside a step are stream waits, bounded by
        # the process groups' own timeout (NCCL's watchdog); `timeout` bounds the safe points.
        self.wait_timeout = None if plan.device.type == "cuda" else timeout
        self.comms = DpComms(
            groups.dp,
            _global_ranks(groups.dp),
            groups.expert_dp,
            _global_ranks(groups.expert_dp),
            dp_collectives,
            self.wait_timeout,
        )
        self.send = torch.zeros(plan.layout.total, dtype=torch.float32, device=plan.device)  # the bucket buffer
        self.state: OptimizerState = fresh_state(plan)
        place = plan.place
        self.pipeline = (
            None
            if plan.strategy.tp_replicated
            else MicroGroupPipeline(
                plan.groups, TpGeometry(place.tp_rank, place.tp_size), groups.tp, plan.device, self.wait_timeout
            )
        )
        team_groups = cooperative.make_team_groups(
            [t for tasks in plan.groups for t in tasks], place.tp_rank, groups.tp, self.wait_timeout
        )
        self.updater = Updater(plan, self.state, team_groups, self.wait_timeout)
        self.round: Round | None = None  # a reduction backward launched, not yet stepped
        self.reduced: list[bool] | None = None  # per entry: has a gradient somewhere (reduced, not yet stepped)
        self.gather: ParamGather | None = None  # gathers still in flight
        self.syncing = True  # False inside no_sync()
        self.broken: str | None = None  # a failed collective: the groups cannot be trusted
        self.failed: str | None = None  # a step failed after state changed: load a checkpoint
        self.skipped = False  # the step's gradients overflowed under a loss scaler: nothing to apply
        self.warned = False

    @property
    def safe_groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """The groups a safe point agrees over (TP, then DP: every rank of the grid)."""
        return self.groups.tp, self.groups.dp

    @contextmanager
    def collectives(self) -> Iterator[None]:
        """Remember a failed collective: the groups cannot be trusted afterwards."""
        if self.broken:
            raise CollectiveError(
                f"canzona: an earlier collective failed ({self.broken}); restart from the last checkpoint"
            )
        try:
            yield
        except CollectiveError as error:
            self.broken = str(error)
            raise

    def check_usable(self) -> None:
        """StepFailedError (on every rank alike: they all failed the same step) once a step
        failed after changing state."""
        if self.failed:
            raise StepFailedError(
                f"canzona: {self.failed}; load a checkpoint (model and optimizer) before stepping again"
            )

    # -- stage 1 and 2: reduce, agree --------------------------------------------------------

    def arrived(self, indices: Sequence[int]) -> None:
        """The entries `indices` (one model tensor's) have their gradient for this backward (a
        gradient hook, or `grad_ready`).
        Inside `no_sync()` nothing is launched (a round already launched is marked stale). After
        `reduce_gradients` nothing is launched either: the coming step uses that reduction.
        Otherwise the first gradient of a backward opens a round (finishing one an earlier
        backward left unstepped and the gathers still in flight: their buffer is this one),
        whose end-of-backward callback launches whatever backward did not produce."""
        current = self.round
        if not self.syncing or self.reduced is not None:
            if current is not None:
                current.stale.update(self.plan.layout.bucket_of[index] for index in indices)
            return
        if current is None or current.closed:
            self.finish_gather()
            self.round = opened = Round(self.plan, self.comms, self.send, self.source, launching=True)
            if current is not None:
                try:
                    current.drain()
                except CollectiveError as error:
                    opened.failure = error
            if torch._C._current_graph_task_id() != -1:  # inside backward: close the round at its end
                torch.autograd.Variable._execution_engine.queue_callback(opened.close)
            current = opened
        current.arrive(indices)

    def reduce(self, problem: str | None, scaling: LossScaling | None = None, digest: int = 0) -> None:
        """Stages 1 and 2 (collective): the DP mean of every gradient in this rank's slices of
        the bucket buffer, agreed by every rank; StepFailedError on every rank if any has a
        problem (nothing changed). With a loss scaler's `scaling`, the ranks also agree whether
        any found an overflow (then `skipped` is set and nothing else happens) and the mean is
        unscaled. Every rank must pass the same hyperparameter `digest` (else StepFailedError on
        every rank). A second call before the step does nothing."""
        if self.reduced is not None:
            return
        step = self.state.step + 1
        with self.collectives():
            self.finish_gather()
            hooked, self.round = self.round, None
            if hooked is None:
                fresh = Round(self.plan, self.comms, self.send, self.source, launching=False)
                if problem is None:
                    fresh.pack_rest()
                buckets = torch.zeros(len(self.plan.layout.buckets), dtype=torch.int32, device=self.plan.device)
                agreed = self._agree(problem or fresh.problem, step, fresh, buckets, scaling, digest)
                fresh.drain()
            else:
                hooked.drain()
                where = "after reducing its gradients"
                agreed = self._agree(problem or hooked.problem, step, hooked, hooked.changes(), scaling, digest, where)
                if agreed.redo:
                    self._warn_overlap_lost(len(agreed.redo))
                    hooked.redo(agreed.redo)
            binding.sum_partial_over_tp(self.plan.partial_spans, self.send, self.groups.tp, self.wait_timeout)
            self.skipped = agreed.overflow
            if scaling is not None and scaling.scale is not None and not agreed.overflow:
                self._unscale(scaling.scale)
            self.reduced = agreed.has_grad

    def _agree(
        self,
        problem: str | None,
        step: int,
        done: Round,
        stale: Tensor,
        scaling: LossScaling | None,
        digest: int,
        where: str = "before its first collective",
    ) -> Agreed:
        """The safe point of the reduction: every rank's problem, and agreed flags (a non-finite
        gradient somewhere, main copies to rebuild, a loss-scaler overflow and the scale, each
        bucket to reduce again, each entry's gradient); rebuilds stale main copies."""
        device, buckets = self.plan.device, len(self.plan.layout.buckets)
        heads = {
            "nonfinite": done.nonfinite,
            "rebuild": self.state.main.stale,
            **_scaling_flags(scaling, device, digest),
        }
        flags = torch.cat(
            [
                *(torch.as_tensor(v, device=device).to(torch.int32).reshape(1) for v in heads.values()),
                stale.to(device=device, dtype=torch.int32),
                torch.tensor(done.has_grad, dtype=torch.int32, device=device),
            ]
        )
        point, failure = (
            f"the safe point of step {step} {where}",
            f"step {step} failed {where}, nothing was applied on any rank",
        )
        values = settle(problem, self.safe_groups, self.timeout, point, failure, device, flags=flags).tolist()
        named = dict(zip(heads, values))
        if named["nonfinite"]:  # a rank saw a non-finite gradient (check_finite): every rank says which
            fail_together(done.nonfinite_problem(), self.safe_groups, point, failure)
        disagreement = _disagreement(named, scaling)
        if disagreement:
            fail_together(disagreement, self.safe_groups, point, failure)
        if named["rebuild"]:
            precision.rebuild(self.plan, self.state.main, self.gather_full, self.state.main.stale)
        rest = values[len(heads) :]
        return Agreed(
            [b for b, flag in enumerate(rest[:buckets]) if flag],
            [bool(f) for f in rest[buckets:]],
            bool(named.get("overflow", 0)),
        )

    def agree_scaling(self, problem: str | None, scaling: LossScaling | None, digest: int = 0) -> None:
        """When the gradients were reduced before the step (by `clip_grad_norm_`): one safe point
        for the step's own problems, the hyperparameters and the loss scaler's overflow
        (collective)."""
        step = self.state.step + 1
        heads = _scaling_flags(scaling, self.plan.device, digest)
        flags = torch.cat(
            [torch.as_tensor(v, device=self.plan.device).to(torch.int32).reshape(1) for v in heads.values()]
        )
        if scaling is not None and scaling.scale is not None:
            problem = problem or (
                "clip_grad_norm_ ran on loss-scaled gradients: unscale them first "
                "(scaler.unscale_(optimizer)), then clip"
            )
        point = f"the start of step {step}"
        failure = f"step {step} failed before applying its update, nothing was applied on any rank"
        with self.collectives():
            named = dict(
                zip(
                    heads,
                    settle(
                        problem, self.safe_groups, self.timeout, point, failure, self.plan.device, flags=flags
                    ).tolist(),
                )
            )
            disagreement = _disagreement(named, scaling)
            if disagreement:
                fail_together(disagreement, self.safe_groups, point, failure)
        self.skipped = bool(named.get("overflow", 0))

    def _unscale(self, scale: Tensor) -> None:
        inverse = scale.double().reciprocal().float().to(self.plan.device)
        for start, stop in self.plan.update_spans:
            self.send[start:stop].mul_(inverse)

    def _warn_overlap_lost(self, count: int) -> None:
        if self.warned:
            return
        self.warned = True
        if dist.get_rank() == 0:
            LOG.warning(
                "canzona: %d gradient bucket(s) changed after backward had reduced them (gradients edited, "
                "replaced or summed by a hook after backward); reduced again at the step, so the overlap with "
                "backward was lost for them (said once)",
                count,
            )

    def refresh_main_copies(self) -> None:
        """Rebuild stale fp32 main copies from the parameters now instead of at the next step
        (collective: every rank calls it, and they agree whether any rank's are stale)."""
        with self.collectives():
            stale = settle(
                None,
                self.safe_groups,
                self.timeout,
                "refreshing the main copies",
                "",
                self.plan.device,
                flags=torch.tensor([int(self.state.main.stale)], device=self.plan.device),
            ).tolist()
            if stale[0]:
                precision.rebuild(self.plan, self.state.main, self.gather_full, self.state.main.stale)

    def gather_full(self, tasks: Sequence[Task], shard_of: Callable[[Task], Tensor]) -> dict[int, Tensor]:
        """Full fp32 matrices of `tasks` on the ranks that update them (collective over TP)."""
        if self.pipeline is None:
            return gather_replicated(tasks, self.groups.tp, shard_of, self.plan.device, self.wait_timeout)
        return self.pipeline.gather_full(tasks, shard_of)

    def clip(self, max_norm: float, norm_type: float) -> Tensor:
        """Scale the reduced gradients of this rank's slices to global norm `max_norm`
        (torch's rule); the norm before clipping (collective)."""
        with self.collectives():
            norm = global_norm(self.plan, self.send, norm_type, self.safe_groups, self.wait_timeout)
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for start, stop in self.plan.update_spans:
            self.send[start:stop].mul_(coefficient)
        return norm

    # -- stage 3 and 4: update, AdamW --------------------------------------------------------

    def update_matrices(self, ctx: StepContext) -> None:
        """Stage 3 (collective over TP): the micro-group pipeline updates the matrices this DP
        rank owns (or TP-SC's replicated updates), in place."""
        plan, updater = self.plan, self.updater
        active = lambda task: ctx.active[task.param] and plan.optimized(task.param)  # noqa: E731
        grad_of = lambda task: self.send[slice(*plan.grad_span(task.param))].view(task.shard_shape(plan.place.tp_rank))  # noqa: E731
        update_of = lambda tasks, full: updater.host_results(ctx, tasks, full)  # noqa: E731
        apply = lambda task, shard: updater.apply(ctx, task, shard)  # noqa: E731
        with self.collectives():
            if self.pipeline is None:
                place = plan.place
                replicated_updates(
                    plan.groups[0],
                    place.tp_rank,
                    place.tp_size,
                    self.groups.tp,
                    grad_of,
                    update_of,
                    apply,
                    plan.device,
                    self.wait_timeout,
                    active,
                )
            else:
                self.pipeline.run(grad_of, update_of, apply, active)

    def update_adamw(self, ctx: StepContext) -> None:
        """Stage 4 (local): AdamW on this rank's slices, in place."""
        self.updater.adamw(ctx, self.send)

    def confirm(self, ctx: StepContext) -> None:
        """The safe point after the update (collective): StepFailedError on every rank if any
        failed (the optimizer is then unusable until a checkpoint is loaded); else the step
        counts advance."""
        try:
            with self.collectives():
                settle(
                    ctx.problem,
                    self.safe_groups,
                    self.timeout,
                    f"the end of step {ctx.step}",
                    f"step {ctx.step} failed while updating; state may have changed on some ranks",
                    self.plan.device,
                )
        except StepFailedError as error:
            self.failed = f"step {ctx.step} failed while updating ({error})"
            raise
        for index, on in enumerate(ctx.active):
            if on and self.plan.counted[index]:
                self.state.param_steps[index] += 1
        self.state.step = ctx.step

    # -- stage 5: publish --------------------------------------------------------------------

    def publish(self, active: list[bool], eager: set[int] | None) -> None:
        """Gather the new values over DP into every rank's parameters; wait for every bucket,
        or (`eager` given: the forward hooks wait for the rest) only for `eager` buckets."""
        if self.plan.strategy.all_dp:
            return  # DP-SC: every rank updated everything in place
        with self.collectives():
            self.gather = ParamGather(self.plan, self.comms, self.send, active)
        self.wait_gather([b for b in self.plan.layout.gather_order if eager is None or b in eager])

    def finish_gather(self) -> None:
        """Wait for every parameter gather still in flight."""
        self.wait_gather(self.plan.layout.gather_order)

    def wait_gather(self, buckets: Iterable[int]) -> None:
        """Wait for the gathers of `buckets` (a module's forward pre-hook calls this)."""
        if self.gather is not None:
            with self.collectives():
                self.gather.wait(buckets)
            if self.gather.done:
                self.gather = None

    def drop_round(self) -> None:
        """Finish and forget a reduction nobody will step (every rank launches the same)."""
        current, self.round = self.round, None
        self.reduced = None
        if current is not None:
            with self.collectives():
                current.drain()
