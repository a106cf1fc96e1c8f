"""`CanzonaOptimizer`: a `torch.optim.Optimizer` that executes a schedule every step under
torch.distributed (docs/runtime.md).

The class is the torch.optim contract (param groups, LR schedulers, closures, pre-hooks,
`zero_grad`, state dicts) over the step engine (`canzona.runtime.engine`). Construction checks
the schedule against the parameters, the process groups and the other ranks, then builds this
rank's frozen plan (`canzona.runtime.plan`) and the engine. A step:

    reduce → agree → update micro-groups → AdamW → publish

Everything that can fail before the state changes (gradients, pre-hooks, the closure,
hyperparameters) is agreed by every rank at one safe point; a failure there raises
`StepFailedError` on every rank with nothing changed. The state is then updated in place; a
failure after that point still raises `StepFailedError` on every rank, and the optimizer then
refuses to step until a checkpoint is loaded. A collective that fails or times out raises
`CollectiveError`.
"""

from __future__ import annotations

import os
import weakref
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from canzona.runtime import binding, experts
from canzona.runtime.engine import Engine, Groups, LossScaling
from canzona.runtime.exchange import comm
from canzona.runtime.exchange.gather import ForwardHooks
from canzona.runtime.exchange.gradients import clip_problem
from canzona.runtime.exchange.reduction import GradSource
from canzona.runtime.faults import as_timedelta, first_line
from canzona.runtime.fsdp.checks import fsdp_mismatch
from canzona.runtime.groups import ResolvedGroups, group_hyperparameters, listed, resolve_param_groups
from canzona.runtime.plan import CANZONA, Place, RankPlan, Strategy, build_rank_plan, strategy_for
from canzona.runtime.process_groups import resolve_process_groups
from canzona.runtime.rules.optimizers import Hyperparameters, MatrixRule, make_rule
from canzona.runtime.schedule import agree, layout_problem, load_schedule, plan_digest, summary, verdict_on
from canzona.runtime.state import logical
from canzona.runtime.state.logical import STATE_FORMAT, Destination, LogicalStateDict, LogicalTensor
from canzona.runtime.update import StepContext
from canzona.schedules.format import Schedule, ScheduleError
from canzona.schedules.layout import local_entries
from canzona.schedules.reshard import StateLayout, incompatibilities, state_layout

PreHook = Callable[..., Any]


class CanzonaOptimizer(torch.optim.Optimizer):
    """Canzona's optimizer step for the live, TP-sharded local parameters of this rank; a
    drop-in `torch.optim.Optimizer` (param_groups, LR schedulers, closures, hooks).

    `params`: `model.named_parameters()` or a list of group dicts whose "params" are
    (name, tensor) pairs, named as in the schedule (see `canzona.runtime.groups` for how groups
    split into matrix and AdamW groups; parameters with `requires_grad=False`, or not passed,
    are never changed). `schedule`: a `Schedule`, a path or a library name. Gradients are this
    rank's own (not reduced over DP), read from `.grad` or, with `grad_attr="main_grad"`, from
    Megatron's fp32 `.main_grad`. Under expert parallelism (schedule `ep` > 1) a rank passes
    the dense parameters and its EP rank's experts, and `expert_dp_group` (or a 3-D `mesh` with
    dims edp, ep, tp) is the group its experts' buckets are reduced over (docs/runtime.md,
    "Expert parallelism"). Construction checks the schedule against the parameters, the
    groups and the other ranks, and raises `ScheduleMismatchError` on every rank if anything is
    wrong. `timeout` (seconds or a timedelta) bounds every collective of a step (None: the
    process groups' own); `check_finite` makes a non-finite local gradient fail the step on
    every rank. `dp_collectives`: "schedule" (default: each bucket as the schedule records it),
    or one form for every bucket: "ring" (a native reduce-scatter / all-gather over slices
    padded to the largest), "rooted" (one reduce to and one broadcast from each non-empty
    slice's owner, a native ring where the slices are equal) or "all_to_all" (one
    all_to_all_single each way, summed here in rank order). `overlap_grad_reduce` (default on):
    each bucket's reduction starts from backward as soon as its gradients exist; whatever the
    gradients hold when the step starts is what is reduced (a bucket whose gradients changed
    after backward is reduced again);
    `overlap_param_gather` (default off; needs `model`): the step returns with its parameter
    gathers in flight and each module of `model` waits for its own before its forward. Other
    keywords are the defaults of every group: see `canzona.runtime.rules.optimizers.Hyperparameters`
    (matrix settings default to the schedule's; `ns_dtype` picks the Newton–Schulz precision)."""

    strategy: Strategy = CANZONA
    _step_supports_amp_scaling = True  # torch.amp.GradScaler hands step() its scale and overflow flag

    def __init__(
        self,
        params: Iterable[Any],
        schedule: Schedule | str | os.PathLike[str],
        *,
        dp_group: dist.ProcessGroup | None = None,
        tp_group: dist.ProcessGroup | None = None,
        mesh: Any = None,
        expert_dp_group: dist.ProcessGroup | None = None,
        timeout: float | timedelta | None = None,
        check_finite: bool = False,
        dp_collectives: str = comm.AS_SCHEDULED,
        grad_attr: str = "grad",
        overlap_grad_reduce: bool = True,
        overlap_param_gather: bool = False,
        model: torch.nn.Module | None = None,
        **defaults: Any,
    ) -> None:
        given = experts.materialized(list(params))
        _check_options(dp_collectives, grad_attr, overlap_grad_reduce, overlap_param_gather, model)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        timeout_delta = as_timedelta(timeout)
        dp, tp, expert_dp = resolve_process_groups(dp_group, tp_group, mesh, expert_dp_group)
        dp_rank = dist.get_rank(dp)
        place = Place(dp_rank, dist.get_world_size(dp), dist.get_rank(tp), dist.get_world_size(tp))
        loaded, resolved, hp, problem = _prepare(given, schedule, defaults, model, place, dp, expert_dp, grad_attr)
        _agree_on(loaded, resolved, problem, place, dp, tp)
        assert loaded is not None and resolved is not None and hp is not None
        self.schedule: Schedule = loaded
        self.digest: str = plan_digest(loaded)
        self.frozen: list[str] = resolved.frozen
        self.hp: Hyperparameters = hp
        self._ready = False
        super().__init__(resolved.groups, {"lr": hp.lr, "weight_decay": hp.weight_decay})
        place = Place(place.dp_rank, place.dp_size, place.tp_rank, place.tp_size, loaded.request.ep)
        self.strategy = strategy_for(type(self).strategy, loaded)
        self.plan: RankPlan = build_rank_plan(loaded, self.param_groups, place, self.strategy)
        self.engine = Engine(
            self.plan, Groups(dp, tp, expert_dp), GradSource(grad_attr, check_finite), dp_collectives, timeout_delta
        )
        # torch.optim types `state` as its own defaultdict; here it is a read-only view of the sharded state
        self.state = StateView(self.plan, self.engine.state)  # type: ignore[assignment]
        self._pre_hooks: OrderedDict[int, PreHook] = OrderedDict()  # RemovableHandle needs a weak reference
        self._grad_hooks: list[RemovableHandle] = []
        self._forward_hooks: ForwardHooks | None = None
        self._install_forward_hooks(model)
        if overlap_grad_reduce and grad_attr == "grad":
            self._grad_hooks = install_grad_hooks(self.plan, weakref.ref(self.engine))
        self._ready = True

    # -- facts about this rank ---------------------------------------------------------------

    @property
    def dp_rank(self) -> int:
        """This rank's DP rank."""
        return self.plan.place.dp_rank

    @property
    def tp_rank(self) -> int:
        """This rank's TP rank."""
        return self.plan.place.tp_rank

    @property
    def dp_size(self) -> int:
        """The DP size."""
        return self.plan.place.dp_size

    @property
    def tp_size(self) -> int:
        """The TP size."""
        return self.plan.place.tp_size

    @property
    def names(self) -> tuple[str, ...]:
        """The schedule's parameter names, in registration order."""
        return self.plan.names

    @property
    def step_count(self) -> int:
        """Steps taken."""
        return self.engine.state.step

    @property
    def param_steps(self) -> list[int]:
        """Steps taken by each schedule entry (registration order)."""
        return self.engine.state.param_steps

    @property
    def hyperparameters(self) -> Hyperparameters:
        """The resolved defaults every group started from (a group's values: `param_groups`)."""
        return self.hp

    # -- the torch.optim contract ------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only at construction: the schedule fixes the parameters (NotImplementedError later)."""
        if getattr(self, "_ready", False):
            raise NotImplementedError(
                "canzona: the optimized parameters are fixed by the schedule at construction; "
                "pass every group to CanzonaOptimizer(...)"
            )
        super().add_param_group(param_group)

    def register_step_pre_hook(self, hook: PreHook) -> RemovableHandle:
        """Run `hook(optimizer, args, kwargs)` inside every step, before its closure and before
        any collective (it may return new (args, kwargs), as in torch.optim). If it raises on
        any rank, the step fails on every rank with nothing applied."""
        handle = RemovableHandle(self._pre_hooks)
        self._pre_hooks[handle.id] = hook
        return handle

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every optimized parameter (`.grad`; a Megatron `.main_grad`
        buffer is its owner's to zero) and drop gradients reduced but not yet stepped (a
        reduction backward launched is finished first: collective, as backward was)."""
        self.engine.drop_round()
        super().zero_grad(set_to_none)

    def _hyperparameters(self) -> tuple[list[Hyperparameters], str | None]:
        """Every group's hyperparameters now (a scheduler or script may have changed them)."""
        rule, hps = self.schedule.request.optimizer.name, []
        for position, group in enumerate(self.param_groups):
            try:
                hps.append(group_hyperparameters(group, self.hp, rule))
            except ValueError as error:
                return [self.hp] * len(self.param_groups), f"param_groups[{position}]: {error}"
        return hps, None

    def _run_pre_hooks(self, closure: Callable[[], Any] | None) -> tuple[Callable[[], Any] | None, str | None]:
        args: tuple[Any, ...] = (self,)
        kwargs: dict[str, Any] = {"closure": closure} if closure is not None else {}
        try:
            for hook in list(self._pre_hooks.values()):
                result = hook(self, args, kwargs)
                if result is not None:
                    args, kwargs = result
        except Exception as error:
            return closure, first_line(error)
        return kwargs.get("closure", args[1] if len(args) > 1 else None), None

    def _run_closure(self, closure: Callable[[], Any] | None, problem: str | None) -> tuple[Any, str | None]:
        if closure is None:
            return None, problem
        if self.engine.reduced is not None:
            return (
                None,
                problem or "step(closure) after clip_grad_norm_/reduce_gradients: the gradients were already reduced",
            )
        try:
            with torch.enable_grad():
                return closure(), problem
        except Exception as error:
            return None, problem or f"the closure raised {first_line(error)}"

    # -- the step ----------------------------------------------------------------------------

    def reduce_gradients(self, problem: str | None = None) -> None:
        """The first two stages of a step (collective): pack, reduce over DP and agree. `step()`
        and `clip_grad_norm_()` call it; a second call before the step does nothing. With
        `overlap_grad_reduce` backward has already launched (most of) the reduction: this waits
        for it, and reduces again the buckets whose gradients changed since. StepFailedError on
        every rank if any rank has a problem (nothing changes)."""
        self.engine.check_usable()
        hps, hp_problem = self._hyperparameters()
        self.engine.reduce(problem or hp_problem, digest=hyperparameter_digest(hps))

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the DP-reduced gradient of the coming step to global norm `max_norm` (collective).

        Reduces the gradients first (if not yet), then computes the norm of the whole DP-mean
        gradient, each element counted once across DP and TP, scales the reduced gradient in
        place by min(1, max_norm / (norm + 1e-6)) (torch's rule) and returns the norm (a 0-dim
        tensor on the parameters' device). `.grad` keeps this rank's own, unreduced gradient."""
        problem = clip_problem(max_norm, norm_type)
        if self.engine.reduced is not None and problem:
            raise ValueError(problem)
        self.reduce_gradients(problem)
        return self.engine.clip(max_norm, float(norm_type))

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step of every parameter (collective: every rank must call it); returns
        the closure's loss (the closure runs with gradients enabled, after the pre-hooks).
        Under `torch.amp.GradScaler` (`scaler.step(optimizer)`) the reduced gradients are
        unscaled here, and a step where any rank's gradients overflowed is skipped on every rank.

        Raises `StepFailedError` on every rank if any rank failed, `CollectiveError` if a
        collective failed or timed out (module docstring)."""
        engine = self.engine
        engine.check_usable()
        closure, problem = self._run_pre_hooks(closure)
        loss, problem = self._run_closure(closure, problem)
        hps, hp_problem = self._hyperparameters()
        scaling = self._loss_scaling()
        try:
            digest = hyperparameter_digest(hps)
            if engine.reduced is not None:  # reduced by clip_grad_norm_: the step agrees on its own problems
                engine.agree_scaling(problem or hp_problem, scaling, digest)
            engine.reduce(problem or hp_problem, scaling, digest)  # stages 1-2: reduce over DP, agree
            active = engine.reduced
            assert active is not None
            if engine.skipped:  # a loss scaler saw an overflow on some rank: nothing to apply
                return loss
            rules: dict[int, MatrixRule] = {
                g: make_rule(self.schedule.request.optimizer.name, hp) for g, hp in enumerate(hps)
            }
            context = StepContext(engine.state.step + 1, active, hps, rules)
            engine.update_matrices(context)  # stage 3: the micro-group pipeline, in place
            engine.update_adamw(context)  # stage 4: AdamW on this rank's slices
            engine.confirm(context)  # every rank's update succeeded
        finally:
            engine.reduced = None
        engine.publish(active, self._forward_hooks.eager if self._forward_hooks else None)  # stage 5: gather over DP
        return loss

    def _loss_scaling(self) -> LossScaling | None:
        """What `torch.amp.GradScaler.step` set on this optimizer (`_step_supports_amp_scaling`):
        its overflow flag and the scale (None once the script called `scaler.unscale_`)."""
        found_inf = getattr(self, "found_inf", None)
        return None if found_inf is None else LossScaling(found_inf, getattr(self, "grad_scale", None))

    # -- overlap -----------------------------------------------------------------------------

    def _install_forward_hooks(self, model: torch.nn.Module | None) -> None:
        if not (self.overlap_param_gather and model is not None and not self.strategy.all_dp):
            return
        layout = self.plan.layout
        bucket_of = {
            key: sorted({layout.bucket_of[i] for i in indices}) for key, indices in self.plan.tensor_entries.items()
        }
        self._forward_hooks = ForwardHooks(weakref.ref(self), model, bucket_of)

    def grad_ready(self, param: Tensor) -> None:
        """Tell the optimizer that `param`'s gradient (its `grad_attr`) is final for this
        backward, so its bucket's reduction may start. `.grad` users never need this (gradient
        hooks call it); with `grad_attr="main_grad"` call it from the hook that accumulates
        `.main_grad` (as Megatron's DDP does before it marks a parameter ready). Ignored
        inside `no_sync()` and without `overlap_grad_reduce`."""
        indices = self.plan.tensor_entries.get(id(param))
        if indices is None:
            raise ValueError("grad_ready: not a parameter this optimizer updates")
        if self.overlap_grad_reduce:
            self.engine.arrived(indices)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside this context launch no reduction
        (their gradients accumulate as usual); the next backward outside it (the last
        micro-batch) reduces the accumulated gradients. Like DDP's `no_sync`."""
        previous, self.engine.syncing = self.engine.syncing, False
        try:
            yield
        finally:
            self.engine.syncing = previous

    def finish_gather(self) -> None:
        """Wait for every parameter gather still in flight (`overlap_param_gather`): call it
        before reading or writing the parameters outside the model's forward (the step,
        state dicts and checkpoints do it themselves). Collective only in that it waits."""
        self.engine.finish_gather()

    def wait_gather(self, buckets: Iterable[int]) -> None:
        """Wait for the gathers of `buckets` (a module's forward pre-hook calls this)."""
        self.engine.wait_gather(buckets)

    def reload_model_params(self) -> None:
        """Rebuild the fp32 main copies from the parameters at the next step (after loading
        model weights into the parameters, e.g. from a model checkpoint). Local; the rebuild
        itself is agreed by every rank at the next step's first safe point."""
        self.engine.finish_gather()
        self.engine.state.main.stale = True

    # -- state -------------------------------------------------------------------------------

    def state_layout(self) -> StateLayout:
        """What decides the logical state's keys and shapes (model, optimizer, shapes)."""
        return state_layout(self.schedule, block_size=self.hp.block_size, max_precond_dim=self.hp.max_precond_dim)

    @property
    def _rule(self) -> MatrixRule:
        return make_rule(self.schedule.request.optimizer.name, self.hp)

    def export_logical(self, writers_only: bool, clone: bool) -> dict[str, LogicalTensor]:
        """This rank's logical state tensors (`writers_only`: one copy of every replica, as a
        checkpoint saves it; `clone`: copies, not views of the live state)."""
        self.engine.finish_gather()
        return logical.export_state(self.plan, self.engine.state, self._rule, writers_only, clone)

    def refresh_main_copies(self) -> None:
        """Rebuild stale fp32 main copies from the parameters now rather than at the next step
        (collective: every rank calls it); a state exported then holds them."""
        self.engine.finish_gather()
        self.engine.refresh_main_copies()

    def logical_destination(self, available: Mapping[str, tuple[int, ...]]) -> Destination:
        """Fresh buffers for the logical state this rank holds, and the chunks that fill them
        (ValueError naming what `available`, key -> full size, lacks)."""
        return logical.plan_import(self.plan, self.engine.state, self._rule, available)

    def install_logical(self, dest: Destination, step: int, param_steps: Mapping[str, int]) -> None:
        """Make a filled destination the optimizer's state; a failed step's refusal ends here."""
        logical.install(self.plan, self.engine.state, dest, step, param_steps)
        self.engine.failed = None

    def check_saved_groups(self, saved: Any, saved_experts: Any = ()) -> list[dict[str, Any]] | None:
        """Saved groups' hyperparameters, checked against these groups (ValueError if unfit)."""
        return logical.check_groups(self.plan, self.param_groups, self.hp, saved, saved_experts)

    def restore_groups(self, saved: list[dict[str, Any]] | None) -> None:
        """Set every group's hyperparameters (and scheduler keys) as saved."""
        logical.restore_groups(self.param_groups, saved)

    def logical_record(self) -> dict[str, Any]:
        """What a state dict or checkpoint records beside the tensors."""
        return {
            "format": STATE_FORMAT,
            "strategy": self.strategy.name,
            "layout": self.state_layout().to_json(),
            "fingerprint": self.schedule.fingerprint,
            "digest": self.digest,
            "schedule": summary(self.schedule),
            "step": self.step_count,
            "param_steps": logical.export_steps(self.plan, self.engine.state),
            "hyperparameters": asdict(self.hp),
            "ep_experts": logical.ep_experts(self.plan),
            "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups],
        }

    @property
    def process_groups(self) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
        """The TP and DP groups (every rank of the grid)."""
        return self.engine.safe_groups

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state in logical form (`canzona.runtime.state.logical`): full-shape,
        schedule-independent tensors (the chunks this rank holds, fp32 main copies included),
        the step counts, every group's hyperparameters, the model's state layout and the
        schedule fingerprint. Any optimizer of the same model can load a set of these that
        covers what it holds (`load_state_dict`), whatever its schedule. Not torch.optim's
        format: checkpoint through `canzona.runtime.save_checkpoint`."""
        return LogicalStateDict(
            {**self.logical_record(), "tensors": self.export_logical(writers_only=False, clone=True)}
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore logical state (one `state_dict()`, or several merged with
        `canzona.runtime.state.checkpoint.merge_state_dicts`) saved under any schedule of the same
        model, and the groups' hyperparameters (the groups must list the same parameters).
        ValueError, with nothing changed, if it is another model's or lacks what this rank
        holds. Missing main copies are rebuilt from the parameters at the next step."""
        self.engine.finish_gather()
        state = state_dict
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(
                f"not a canzona optimizer state (format {found!r}, expected {STATE_FORMAT!r}); "
                f"{logical.UNSUPPORTED_STATE.removeprefix('canzona: ')}"
            )
        problems = incompatibilities(StateLayout.from_json(state["layout"]), self.state_layout())
        if problems:
            raise ValueError("the optimizer state does not fit this model: " + "; ".join(problems))
        groups = self.check_saved_groups(state.get("param_groups"), state.get("ep_experts", ()))
        tensors = state["tensors"]
        dest = self.logical_destination({key: tuple(value.size) for key, value in tensors.items()})
        logical.fill_from(dest, tensors)
        self.install_logical(dest, int(state["step"]), state.get("param_steps", {}))
        self.restore_groups(groups)


class StateView(Mapping[Tensor, dict[str, Any]]):
    """`optimizer.state` for code written against torch.optim: each optimized parameter maps to
    its step count. The state itself is sharded across ranks (see `state_dict()`)."""

    def __init__(self, plan: RankPlan, state: Any) -> None:
        self._plan, self._state = plan, state

    def __getitem__(self, param: Tensor) -> dict[str, Any]:
        indices = self._plan.tensor_entries.get(id(param))
        if indices is None:
            raise KeyError("not a parameter of this optimizer")
        return {"step": self._state.param_steps[indices[0]]}

    def __iter__(self) -> Iterator[Tensor]:
        return (param for param, _ in self._plan.model_params())

    def __len__(self) -> int:
        return len(self._plan.tensor_entries)


# -- construction helpers ------------------------------------------------------------------


def hyperparameter_digest(hps: list[Hyperparameters]) -> int:
    """A 31-bit digest of every group's hyperparameters, which the ranks compare at the safe
    point: one rank alone with another lr would make TP replicas diverge for good."""
    return zlib.crc32(repr(hps).encode()) & 0x7FFFFFFF


def _check_options(
    dp_collectives: str, grad_attr: str, overlap_grad_reduce: Any, overlap_param_gather: Any, model: Any
) -> None:
    if dp_collectives not in comm.DP_COLLECTIVES:
        raise ValueError(f"dp_collectives must be one of {', '.join(comm.DP_COLLECTIVES)}, got {dp_collectives!r}")
    if not isinstance(grad_attr, str) or not grad_attr.isidentifier():
        raise ValueError(f"grad_attr must be an attribute name such as 'grad' or 'main_grad', got {grad_attr!r}")
    for name, flag in (("overlap_grad_reduce", overlap_grad_reduce), ("overlap_param_gather", overlap_param_gather)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be True or False, got {flag!r}")
    if overlap_param_gather and not isinstance(model, torch.nn.Module):
        raise ValueError("overlap_param_gather=True needs model=<the torch.nn.Module whose parameters are optimized>")


Prepared = tuple[Schedule | None, ResolvedGroups | None, Hyperparameters | None, str | None]


def _prepare(
    given: list[Any],
    schedule: Schedule | str | os.PathLike[str],
    defaults: dict[str, Any],
    model: torch.nn.Module | None,
    place: Place,
    dp_group: Any,
    expert_group: Any,
    grad_attr: str,
) -> Prepared:
    """Load and check locally; every failure becomes this rank's verdict, not an exception."""
    try:
        loaded = schedule if isinstance(schedule, Schedule) else load_schedule(schedule)
    except ScheduleError as error:
        return None, None, None, str(error)
    sharding_problem = fsdp_mismatch(loaded, given)
    if sharding_problem:
        return loaded, None, None, sharding_problem
    ep = loaded.request.ep
    ep_rank = place.dp_rank % ep
    dp_ranks = dist.get_process_group_ranks(dp_group)
    expert_problem = (
        experts.expert_group_problem(loaded, place.dp_rank, dp_ranks, expert_group)
        if place.dp_size == loaded.request.dp
        else None
    )
    expert_problem = expert_problem or experts.foreign_experts(loaded, experts.given_names(given), place.dp_rank)
    if expert_problem:
        return loaded, None, None, expert_problem
    try:
        hp = Hyperparameters.from_kwargs(defaults).resolved(loaded.request.optimizer)
    except (TypeError, ValueError) as error:
        return loaded, None, None, f"bad hyperparameters: {error}"
    held = local_entries(loaded, ep_rank)  # dense and this EP rank's experts
    entries = binding.model_entries(held)
    resolved = resolve_param_groups(
        given, entries, loaded.request.tp, loaded.request.optimizer.name, hp, grad_attr, tp_rank=place.tp_rank
    )
    problems = [p for p in [layout_problem(loaded, place.dp_size, place.tp_size)] if p]
    if ep > 1:
        pairs = [pair for group in resolved.groups for pair in group["params"]]
        problems += binding.expert_count_problems(pairs, held)
    problems += resolved.problems
    if model is not None:
        inside = {id(p) for p in model.parameters()}
        outside = [name for group in resolved.groups for name, tensor in group["params"] if id(tensor) not in inside]
        problems += [f"{name}: not a parameter of the model given as model=" for name in outside[:3]]
    if problems:
        return loaded, resolved, hp, "parameters do not match the schedule: " + listed(problems, "; ")
    return loaded, resolved, hp, None


def _agree_on(
    loaded: Schedule | None,
    resolved: ResolvedGroups | None,
    problem: str | None,
    place: Place,
    dp_group: dist.ProcessGroup,
    tp_group: dist.ProcessGroup,
) -> None:
    """Every rank's verdict; the same ScheduleMismatchError on every rank if any is unfit."""
    placed = {e.name for e in loaded.params if e.ep_rank is not None} if loaded else set()
    verdict = verdict_on(
        loaded,
        dist.get_rank(),
        place.dp_rank,
        place.tp_rank,
        problem,
        frozen=", ".join(n for n in resolved.frozen if n not in placed) if resolved else None,
        frozen_experts=", ".join(n for n in resolved.frozen if n in placed) if resolved else None,
        ep=loaded.request.ep if loaded else 1,
    )
    agree(verdict, dp_group, tp_group)


def install_grad_hooks(plan: RankPlan, engine: Callable[[], Engine | None]) -> list[RemovableHandle]:
    """A post-accumulate-grad hook on every optimized model parameter: its gradient is final
    (for each schedule entry it holds: a grouped expert tensor holds several). `engine()` is
    the engine (held weakly: the hooks never keep it alive)."""
    return [
        param.register_post_accumulate_grad_hook(_on_grad(engine, indices)) for param, indices in plan.model_params()
    ]


def _on_grad(engine: Callable[[], Engine | None], indices: tuple[int, ...]) -> Callable[[Tensor], None]:
    def hook(param: Tensor) -> None:
        target = engine()
        if target is not None:
            target.arrived(indices)

    return hook
