"""`CanzonaOptimizer`: a `torch.optim.Optimizer` that executes a schedule every step under
torch.distributed (docs/runtime.md).

One step: reduce the gradients (pack in fp32, per bucket an uneven reduce-scatter over DP: the
mean), started from backward's gradient hooks when `overlap_grad_reduce` (`exchange/reduction.py`); the
TP micro-group pipeline for the matrices this DP rank owns; AdamW on this rank's equal slices;
per bucket an uneven all-gather of the updated values over DP (in the model dtype), written back
in place, optionally overlapped with the next forward (`exchange/gather.py`). Low-precision parameters
are updated through fp32 main copies (`canzona.runtime.rules.precision`).

A step is a transaction: updates and new state are computed into scratch, every rank agrees
that nobody failed (a safe point before the first data collective and one before applying),
and only then are parameters and state replaced. A failure anywhere raises `StepFailedError`
on every rank and changes nothing; a collective that fails or times out raises `CollectiveError`.
"""

from __future__ import annotations

import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from canzona.schedules.format import Schedule, ScheduleError
from canzona.schedules.reshard import StateLayout, incompatibilities, state_layout
from canzona.runtime import binding, experts
from canzona.runtime.exchange import comm, gradients, reduction
from canzona.runtime.rules import precision
from canzona.runtime.state import logical
from canzona.runtime.faults import CollectiveError, as_timedelta, settle
from canzona.runtime.exchange.gather import ForwardHooks, ParamGather
from canzona.runtime.groups import ResolvedGroups, group_hyperparameters, resolve_param_groups
from canzona.runtime.layout import EXPERT, DpBucket, Task, build_dp_layout, local_entries, matrix_tasks, micro_groups
from canzona.runtime.rules.optimizers import Hyperparameters, State, make_rule
from canzona.runtime.exchange.pipeline import MicroGroupPipeline, hosts_here
from canzona.runtime.process_groups import resolve_process_groups
from canzona.runtime.fsdp.checks import fsdp_mismatch
from canzona.runtime.schedule import DTYPES, Verdict, agree, layout_problem, load_schedule, plan_digest, summary
from canzona.runtime.update import Transaction, UpdateStage, problem_line

STATE_FORMAT = "canzona-logical/1"
PreHook = Callable[..., Any]


def _widest(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype updated values travel in over DP: the model's one dtype, else fp32 (exact for
    bf16 and fp16 alike)."""
    found = set(dtypes)
    return found.pop() if len(found) == 1 else torch.float32


class CanzonaOptimizer(UpdateStage, torch.optim.Optimizer):
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
    slice's owner, a native ring where the slices are equal; the backend's summation order) or
    "all_to_all" (one all_to_all_single each way, summed here in rank order). `overlap_grad_reduce` (default on): each bucket's reduction starts from
    backward as soon as its gradients exist (gradient hooks; `no_sync()` for accumulation);
    `overlap_param_gather` (default off; needs `model`): the step returns with its parameter
    gathers in flight and each module of `model` waits for its own before its forward. Other
    keywords are the defaults of every group: see `canzona.runtime.rules.optimizers.Hyperparameters`
    (matrix settings default to the schedule's)."""

    strategy = "canzona"
    gathers = True  # whether the strategy gathers parameters over DP after its update

    def __init__(self, params: Iterable[Any], schedule: Schedule | str | os.PathLike[str], *,
                 dp_group: dist.ProcessGroup | None = None, tp_group: dist.ProcessGroup | None = None,
                 mesh: Any = None, expert_dp_group: dist.ProcessGroup | None = None,
                 timeout: float | timedelta | None = None, check_finite: bool = False,
                 dp_collectives: str = comm.AS_SCHEDULED, grad_attr: str = "grad", overlap_grad_reduce: bool = True,
                 overlap_param_gather: bool = False, model: torch.nn.Module | None = None, **defaults: Any) -> None:
        given = experts.materialized(list(params))
        if dp_collectives not in comm.DP_COLLECTIVES:
            raise ValueError(f"dp_collectives must be one of {', '.join(comm.DP_COLLECTIVES)}, got {dp_collectives!r}")
        if not isinstance(grad_attr, str) or not grad_attr.isidentifier():
            raise ValueError(f"grad_attr must be an attribute name such as 'grad' or 'main_grad', got {grad_attr!r}")
        for name, flag in (("overlap_grad_reduce", overlap_grad_reduce), ("overlap_param_gather", overlap_param_gather)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be True or False, got {flag!r}")
        if overlap_param_gather and not isinstance(model, torch.nn.Module):
            raise ValueError("overlap_param_gather=True needs model=<the torch.nn.Module whose parameters are optimized>")
        self.dp_collectives = dp_collectives
        self.overlap_grad_reduce = overlap_grad_reduce
        self.overlap_param_gather = overlap_param_gather
        self.timeout = as_timedelta(timeout)
        self.check_finite = check_finite
        self.grad_attr = grad_attr
        self.dp_group, self.tp_group, self.expert_dp_group = resolve_process_groups(dp_group, tp_group, mesh, expert_dp_group)
        self.dp_size, self.dp_rank = dist.get_world_size(self.dp_group), dist.get_rank(self.dp_group)
        self._dp_ranks = [dist.get_global_rank(self.dp_group, r) for r in range(self.dp_size)]
        self.tp_size, self.tp_rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
        loaded, resolved, problem = self._prepare(given, schedule, defaults, model)
        placed = {e.name for e in loaded.params if e.ep_rank is not None} if loaded else set()
        verdict = Verdict(
            rank=dist.get_rank(), dp_rank=self.dp_rank, tp_rank=self.tp_rank, problem=problem,
            fingerprint=loaded.fingerprint if loaded else None,
            digest=plan_digest(loaded) if loaded else None,
            summary=summary(loaded) if loaded else "no schedule",
            frozen=", ".join(n for n in resolved.frozen if n not in placed) if resolved else None,
            frozen_experts=", ".join(n for n in resolved.frozen if n in placed) if resolved else None,
            ep=loaded.request.ep if loaded else 1,
        )
        agree(verdict, self.dp_group, self.tp_group)
        assert loaded is not None and resolved is not None and verdict.digest is not None
        self.schedule: Schedule = loaded
        self.digest: str = verdict.digest
        self.frozen: list[str] = resolved.frozen
        self._ready = False
        super().__init__(resolved.groups, {"lr": self.hp.lr, "weight_decay": self.hp.weight_decay})
        self.state = logical.StateView(self)  # type: ignore[assignment]
        self._pre_hooks: OrderedDict[int, PreHook] = OrderedDict()  # RemovableHandle needs a weak reference
        self._broken: str | None = None
        self._pending: Transaction | None = None
        self._reduced: gradients.Reduced | None = None
        self._round: reduction.Round | None = None
        self._gather: ParamGather | None = None
        self._syncing = True
        self._setup()
        self._install_hooks(model)
        self._ready = True

    def _prepare(self, given: list[Any], schedule: Schedule | str | os.PathLike[str], defaults: dict[str, Any],
                 model: torch.nn.Module | None) -> tuple[Schedule | None, ResolvedGroups | None, str | None]:
        """Load and check locally; every failure becomes this rank's verdict, not an exception."""
        try:
            loaded = schedule if isinstance(schedule, Schedule) else load_schedule(schedule)
        except ScheduleError as error:
            return None, None, str(error)
        sharding_problem = fsdp_mismatch(loaded, given)
        if sharding_problem:
            return loaded, None, sharding_problem
        rule, self.ep = loaded.request.optimizer.name, loaded.request.ep
        self.ep_rank = experts.ep_rank_of(self.dp_rank, self.ep)
        expert_problem = (experts.expert_group_problem(loaded, self.dp_rank, self._dp_ranks, self.expert_dp_group)
                          if self.dp_size == loaded.request.dp else None)
        expert_problem = expert_problem or experts.foreign_experts(loaded, experts.given_names(given), self.dp_rank)
        if expert_problem:
            return loaded, None, expert_problem
        try:
            self.hp = Hyperparameters.from_kwargs(defaults).resolved(loaded.request.optimizer)
        except (TypeError, ValueError) as error:
            return loaded, None, f"bad hyperparameters: {error}"
        entries = binding.model_entries(local_entries(loaded, self.ep_rank))  # dense and this EP rank's experts
        resolved = resolve_param_groups(given, entries, loaded.request.tp, rule, self.hp, self.grad_attr)
        problems = [p for p in [layout_problem(loaded, self.dp_size, self.tp_size)] if p]
        if self.ep > 1:
            pairs = [pair for group in resolved.groups for pair in group["params"]]
            problems += binding.expert_count_problems(pairs, local_entries(loaded, self.ep_rank))
        problems += resolved.problems
        if model is not None:
            inside = {id(p) for p in model.parameters()}
            outside = [name for group in resolved.groups for name, tensor in group["params"] if id(tensor) not in inside]
            problems += [f"{name}: not a parameter of the model given as model=" for name in outside[:3]]
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            return loaded, resolved, "parameters do not match the schedule: " + "; ".join(problems[:3]) + more
        return loaded, resolved, None

    def _setup(self) -> None:
        entries = sorted(self.schedule.params, key=lambda e: e.index)
        self.names = [e.name for e in entries]
        self._tp_dims = [e.tp_dim for e in entries]
        self._dtypes = [DTYPES[e.dtype] for e in entries]
        self._lowp = [dtype != torch.float32 for dtype in self._dtypes]
        self._numel = [e.numel for e in entries]
        self._grad_reduce = [e.grad_reduce for e in entries]
        self._bind_params(len(entries))
        self.device = self._param(self._managed_indices[0]).device
        self._wire_dtype = _widest(self._dtypes)
        self.param_steps = [0] * len(entries)
        self.layout = build_dp_layout(self.schedule, self.ep_rank)
        local = {e.index for e in local_entries(self.schedule, self.ep_rank)}
        # step counts of every parameter but the frozen ones (another EP rank's experts too: the
        # ranks agree on which parameters had a gradient, so every rank counts alike)
        self._counted = [self._managed[i] or i not in local for i in range(len(entries))]
        self._expert = [e.ep_rank is not None for e in entries]
        self.rule = make_rule(self.schedule.request.optimizer.name, self.hp)
        self.step_count = 0
        self.matrix_state: dict[int, list[State]] = {}
        self._send = torch.zeros(self.layout.total, dtype=torch.float32, device=self.device)  # the bucket buffer
        edp_size = dist.get_world_size(self.expert_dp_group) if self.ep > 1 else 0
        self._edp_ranks = [dist.get_global_rank(self.expert_dp_group, r) for r in range(edp_size)]
        self._flat_params = [None if p is None else p.detach().view(-1) for p in self._params]
        self._ranks = self._updated_ranks()
        self._base = self.layout.starts[self._ranks[0]]
        self._size = sum(self.layout.sizes[r] for r in self._ranks)
        self._partial_runs = binding.partial_runs(self)
        matrix_end = {r: self.layout.starts[r] + self.layout.matrix_sizes[r] for r in self._ranks}
        self._offsets = {  # owned matrices are one piece each, inside the matrix part of a slice
            p.param: p.dst - self._base for r in self._ranks for p in self.layout.rank_pieces[r] if p.dst < matrix_end[r]
        }
        self._fp32_pieces = [p for r in self._ranks for p in self.layout.rank_pieces[r] if self._managed[p.param] and not self._lowp[p.param]]
        adamw = sum(self.layout.sizes[r] - self.layout.matrix_sizes[r] for r in self._ranks)
        self.adamw_state = {name: torch.zeros(adamw, dtype=torch.float32, device=self.device) for name in ("exp_avg", "exp_avg_sq")}
        self._setup_matrices()
        hosted = set(self._hosted)
        self._tasks: dict[int, Task] = {t.param: t for t in matrix_tasks(self.schedule).values() if t.param in hosted}
        self._tasks.update(getattr(self, "_team_tasks", {}))  # a team member's: its slice (`canzona.runtime.rules.cooperative`)
        self._adamw_pieces = precision.adamw_pieces(self)
        self.main = precision.allocate(self)
        self._norm_runs = gradients.norm_runs(self)

    def _bind_params(self, count: int) -> None:
        """Bind every schedule entry to its model parameter (`canzona.runtime.binding`): `_params`
        holds each entry's local values (DTensor shards, expert slices: views), `_bound` how its
        gradient is read, `_indices_of_tensor` the entries of each model parameter."""
        held = local_entries(self.schedule, self.ep_rank)
        by_name, slices = binding.model_entries(held), binding.slices_of(held)
        self._params: list[Tensor | None] = [None] * count
        self._bound: list[binding.Bound | None] = [None] * count
        self._group_of: list[int] = [-1] * count
        self._indices_of_tensor: dict[int, list[int]] = {}
        for position, group in enumerate(self.param_groups):
            for name, tensor in zip(group["param_names"], group["params"]):
                for index, bound in binding.bind(name, tensor, by_name, slices):
                    self._params[index], self._bound[index], self._group_of[index] = bound.value, bound, position
                    self._indices_of_tensor.setdefault(id(tensor), []).append(index)
        self._managed = [p is not None for p in self._params]
        self._managed_indices = [i for i, managed in enumerate(self._managed) if managed]
        self._index_of_tensor = {key: indices[0] for key, indices in self._indices_of_tensor.items()}

    def _model_param(self, index: int) -> Tensor:
        """The model's parameter holding entry `index` (a DTensor, a grouped tensor, ...)."""
        bound = self._bound[index]
        assert bound is not None, f"{self.names[index]} is not optimized here"
        return bound.param

    def _param(self, index: int) -> Tensor:
        param = self._params[index]
        assert param is not None, f"{self.names[index]} is not optimized here"
        return param

    def _updated_ranks(self) -> list[int]:
        """DP ranks whose slices this rank updates (canzona: its own)."""
        return [self.dp_rank]

    def _setup_matrices(self) -> None:
        groups = micro_groups(self.schedule, self.dp_rank)
        self.pipeline = MicroGroupPipeline(groups, self.tp_rank, self.tp_size, self.tp_group, self.device, self.timeout)
        self._hosted = [t.param for tasks in groups for t in tasks if hosts_here(t, self.tp_rank)]
        self._team_tasks = {t.param: t for tasks in groups for t in tasks if t.team and hosts_here(t, self.tp_rank)}

    def _group_tasks(self) -> list[Task]:
        """Every matrix this rank's TP group updates (any host)."""
        return [t for tasks in self.pipeline.groups for t in tasks]

    def _gather_full(self, tasks: list[Task], shard_of: Callable[[Task], Tensor]) -> dict[int, Tensor]:
        """Full fp32 matrices of `tasks` on the ranks that update them (collective over TP)."""
        return self.pipeline.gather_full(tasks, shard_of)

    def _writes_matrix(self, param: int) -> bool:
        """Whether this rank saves the state of matrix `param` it holds (one copy of each replica)."""
        return True

    def _writes_adamw(self, replicated: bool) -> bool:
        """Whether this rank saves its AdamW state of a parameter (`replicated` over TP)."""
        return not replicated or self.tp_rank == 0

    @cached_property
    def _adamw_runs(self) -> list[logical.AdamwRun]:
        return logical.adamw_runs(self)

    @property
    def hyperparameters(self) -> Hyperparameters:
        """The resolved defaults every group started from (a group's values: `param_groups`)."""
        return self.hp

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only at construction: the schedule fixes the parameters (NotImplementedError later)."""
        if getattr(self, "_ready", False):
            raise NotImplementedError("canzona: the optimized parameters are fixed by the schedule at construction; "
                                      "pass every group to CanzonaOptimizer(...)")
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
        self._reduced = None
        self._drop_round()
        super().zero_grad(set_to_none)

    def reload_model_params(self) -> None:
        """Rebuild the fp32 main copies from the parameters at the next step (after loading
        model weights into the parameters, e.g. from a model checkpoint). Local; the rebuild
        itself is agreed by every rank at the next step's first safe point."""
        self.finish_gather()
        self.main.stale = True

    @contextmanager
    def _collectives(self) -> Iterator[None]:
        """Remember a failed collective: the groups cannot be trusted afterwards."""
        if self._broken:
            raise CollectiveError(f"canzona: an earlier collective failed ({self._broken}); restart from the last checkpoint")
        try:
            yield
        except CollectiveError as error:
            self._broken = str(error)
            raise

    def _settle(self, problem: str | None, step: int, before_collectives: bool, flags: Tensor | None = None) -> Tensor:
        where = "before its first collective" if before_collectives else "before applying its update"
        failure = f"step {step} failed {where}, nothing was applied on any rank"
        return settle(problem, (self.tp_group, self.dp_group), self.timeout, f"the safe point of step {step} {where}",
                      failure, self.device, flags=flags)

    def _hyperparameters(self) -> tuple[list[Hyperparameters], str | None]:
        """Every group's hyperparameters now (a scheduler or script may have changed them)."""
        rule, hps = self.schedule.request.optimizer.name, []
        for position, group in enumerate(self.param_groups):
            try:
                hps.append(group_hyperparameters(group, self.hp, rule))
            except ValueError as error:
                return [self.hp] * len(self.param_groups), f"param_groups[{position}] ({group['kind']}): {error}"
        return hps, None

    def reduce_gradients(self, problem: str | None = None) -> None:
        """The first phase of a step (collective): check, pack and reduce this rank's gradients
        over DP, keeping the result for the step. `step()` and `clip_grad_norm_()` call it;
        a second call before the step does nothing. With `overlap_grad_reduce` backward has
        already launched (most of) the reduction: this waits for it. StepFailedError on every
        rank if any rank has a problem (nothing changes)."""
        if self._reduced is not None:
            return
        step = self.step_count + 1
        with self._collectives():
            self.finish_gather()
            problem = problem or self._hyperparameters()[1]
            hooked, self._round = self._round, None
            if hooked is not None:  # launched from backward: wait, then agree
                hooked.launch_rest()
                grads = hooked.wait()
                agreed = self._agree(problem or hooked.problem, step, "after reducing its gradients", hooked)
                if not agreed[1]:
                    binding.sum_partial_over_tp(self, grads)
                    self._reduced = gradients.Reduced(grads, [bool(flag) for flag in agreed[2:]])
                    return
            fresh = reduction.Round(self, launching=False)
            if problem is None:
                fresh.pack_rest()
            agreed = self._agree(problem or fresh.problem, step, "before its first collective", fresh)
            fresh.launch_rest()
            grads = fresh.wait()
            binding.sum_partial_over_tp(self, grads)
        self._reduced = gradients.Reduced(grads, [bool(flag) for flag in agreed[2:]])

    def _agree(self, problem: str | None, step: int, where: str, done: reduction.Round) -> list[int]:
        """The safe point of the reduction: every rank's problem, and agreed flags [main copies
        stale, round to redo, has a gradient per parameter...]; rebuilds stale main copies."""
        flags = torch.tensor([int(self.main.stale), int(done.stale)] + [int(h) for h in done.has_grad],
                             dtype=torch.int32, device=self.device)
        failure = f"step {step} failed {where}, nothing was applied on any rank"
        agreed = settle(problem, (self.tp_group, self.dp_group), self.timeout, f"the safe point of step {step} {where}",
                        failure, self.device, flags=flags).tolist()
        if agreed[0]:
            precision.rebuild(self, self.main.stale)
        return agreed

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> Tensor:
        """Clip the DP-reduced gradient of the coming step to global norm `max_norm` (collective).

        Reduces the gradients first (if not yet), then computes the norm of the whole DP-mean
        gradient, each element counted once across DP and TP, scales the reduced gradient in
        place by min(1, max_norm / (norm + 1e-6)) (torch's rule) and returns the norm (a 0-dim
        tensor on the parameters' device). `.grad` keeps this rank's own, unreduced gradient."""
        problem = gradients.clip_problem(max_norm, norm_type)
        if self._reduced is not None and problem:
            raise ValueError(problem)
        self.reduce_gradients(problem)
        assert self._reduced is not None
        with self._collectives():
            norm = gradients.global_norm(self, self._reduced.grads, float(norm_type))
        self._reduced.grads.mul_((max_norm / (norm + 1e-6)).clamp(max=1.0))
        return norm

    def _run_pre_hooks(self, closure: Callable[[], Any] | None) -> tuple[Callable[[], Any] | None, str | None]:
        args: tuple[Any, ...] = (self,)
        kwargs: dict[str, Any] = {"closure": closure} if closure is not None else {}
        try:
            for hook in list(self._pre_hooks.values()):
                result = hook(self, args, kwargs)
                if result is not None:
                    args, kwargs = result
        except Exception as error:  # noqa: BLE001 - reported to every rank at the safe point
            return closure, problem_line(error)
        return kwargs.get("closure", args[1] if len(args) > 1 else None), None

    def _run_closure(self, closure: Callable[[], Any] | None, problem: str | None) -> tuple[Any, str | None]:
        if closure is None:
            return None, problem
        if self._reduced is not None:
            return None, problem or "step(closure) after clip_grad_norm_/reduce_gradients: the gradients were already reduced"
        try:
            with torch.enable_grad():
                return closure(), problem
        except Exception as error:  # noqa: BLE001 - reported to every rank at the safe point
            return None, problem or f"the closure raised {problem_line(error)}"

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One optimizer step of every parameter (collective: every rank must call it); returns
        the closure's loss (the closure runs with gradients enabled, after the pre-hooks).

        Raises `StepFailedError` on every rank if any rank failed (nothing applied anywhere),
        `CollectiveError` if a collective failed or timed out."""
        closure, problem = self._run_pre_hooks(closure)
        loss, problem = self._run_closure(closure, problem)
        try:
            self.reduce_gradients(problem if self._reduced is None else None)
            reduced = self._reduced
            assert reduced is not None
            hps, hp_problem = self._hyperparameters()
            pending = Transaction(self.step_count + 1, reduced.active, hps,
                               {g: self._group_rule(hps[g]) for g, group in enumerate(self.param_groups) if group["kind"] == "matrix"})
            pending.problem = problem or hp_problem
            with self._collectives():
                self._update(reduced.grads, pending)
        finally:
            self._reduced = None
        self._commit(pending)
        return loss

    def _bucket_group(self, b: DpBucket) -> tuple[dist.ProcessGroup, list[int], int]:
        """A bucket's process group (expert buckets: the expert-DP group), its ranks' global
        ranks, and this rank's rank in it."""
        if b.kind == EXPERT:
            return self.expert_dp_group, self._edp_ranks, b.dp_ranks.index(self.dp_rank)
        return self.dp_group, self._dp_ranks, self.dp_rank

    def _start_reduce(self, bucket: int, grads: Tensor) -> comm.Pending:
        """Launch the DP mean of one bucket of `_send` into `grads` (region coordinates): summed
        over its group, divided by the DP size (see `canzona.runtime.experts` for experts)."""
        b = self.layout.buckets[bucket]
        group, ranks, rank = self._bucket_group(b)
        dests = {p: grads[b.region_starts[p] - self._base : b.region_starts[p] - self._base + b.slices[p]]
                 for p, r in enumerate(b.dp_ranks) if r in self._ranks}
        mode = comm.bucket_mode(b, self.dp_collectives) if self.gathers else comm.ALL_REDUCE
        return comm.start_reduce(self._send, b, mode, rank, group, ranks, dests, self.dp_size)

    def _start_gather(self, bucket: int, gathered: Tensor, out: Tensor) -> comm.Pending:
        """Launch the gather of one bucket of the new values `out` (region coordinates)."""
        b = self.layout.buckets[bucket]
        group, ranks, rank = self._bucket_group(b)
        start = b.region_starts[rank] - self._base
        mine = out[start : start + b.slices[rank]]
        return comm.start_gather(gathered, mine, b, comm.bucket_mode(b, self.dp_collectives), rank, group, ranks)

    def _targets(self, active: list[bool]) -> list[Tensor | None]:
        return [flat if active[i] else None for i, flat in enumerate(self._flat_params)]

    def _publish(self, out: Tensor, active: list[bool]) -> None:
        """Launch every bucket's gather; wait for all of them unless the model's forward hooks
        will (then only for buckets no module's hook covers)."""
        gather = self._gather = ParamGather(self, out, active)
        if self._forward_hooks is None:
            gather.finish()
        else:
            gather.wait([b for b in self.layout.gather_order if b in self._forward_hooks.eager])
        if gather.done:
            self._gather = None

    def _install_hooks(self, model: torch.nn.Module | None) -> None:
        self._grad_hooks = reduction.install_grad_hooks(self) if self.overlap_grad_reduce and self.grad_attr == "grad" else []
        self._forward_hooks: ForwardHooks | None = None
        if self.overlap_param_gather and model is not None and self.gathers:
            bucket_of = {key: sorted({self.layout.bucket_of[i] for i in indices}) for key, indices in self._indices_of_tensor.items()}
            self._forward_hooks = ForwardHooks(self, model, bucket_of)

    def weak(self) -> weakref.ref[CanzonaOptimizer]:
        """A weak reference to this optimizer (hooks hold these, so they never keep it alive)."""
        return weakref.ref(self)

    def grad_ready(self, param: Tensor) -> None:
        """Tell the optimizer that `param`'s gradient (its `grad_attr`) is final for this
        backward, so its bucket's reduction may start. `.grad` users never need this (gradient
        hooks call it); with `grad_attr="main_grad"` call it from the hook that accumulates
        `.main_grad` (as Megatron's DDP does before it marks a parameter ready). Ignored
        inside `no_sync()` and without `overlap_grad_reduce`."""
        indices = self._indices_of_tensor.get(id(param))
        if indices is None:
            raise ValueError("grad_ready: not a parameter this optimizer updates")
        if self.overlap_grad_reduce:
            for index in indices:
                reduction.arrived(self, index)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside this context launch no reduction
        (their gradients accumulate as usual); the next backward outside it (the last
        micro-batch) reduces the accumulated gradients. Like DDP's `no_sync`."""
        previous, self._syncing = self._syncing, False
        try:
            yield
        finally:
            self._syncing = previous

    def finish_gather(self) -> None:
        """Wait for every parameter gather still in flight (`overlap_param_gather`): call it
        before reading or writing the parameters outside the model's forward (the step,
        state dicts and checkpoints do it themselves). Collective only in that it waits."""
        if self._gather is not None:
            with self._collectives():
                self._gather.finish()
            self._gather = None

    def wait_gather(self, buckets: list[int]) -> None:
        """Wait for the gathers of `buckets` (a module's forward pre-hook calls this)."""
        if self._gather is not None:
            with self._collectives():
                self._gather.wait(buckets)
            if self._gather.done:
                self._gather = None

    def _drop_round(self) -> None:
        """Finish and forget a reduction nobody will step (every rank launches the same)."""
        current, self._round = self._round, None
        if current is not None:
            with self._collectives():
                current.drain()

    def state_layout(self) -> StateLayout:
        """What decides the logical state's keys and shapes (model, optimizer, shapes)."""
        return state_layout(self.schedule, block_size=self.hp.block_size, max_precond_dim=self.hp.max_precond_dim)

    def _saved_groups(self) -> list[dict[str, Any]]:
        return [{key: value for key, value in group.items() if key != "params"} for group in self.param_groups]

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """This rank's optimizer state in logical form (`canzona.runtime.state.logical`): full-shape,
        schedule-independent tensors (the chunks this rank holds, fp32 main copies included),
        the step counts, every group's hyperparameters, the model's state layout and the
        schedule fingerprint. Any optimizer of the same model can load a set of these that
        covers what it holds (`load_state_dict`), whatever its schedule. Not torch.optim's
        format: checkpoint through `canzona.runtime.save_checkpoint`."""
        self.finish_gather()
        return logical.LogicalStateDict({
            "format": STATE_FORMAT,
            "strategy": self.strategy,
            "layout": self.state_layout().to_json(),
            "fingerprint": self.schedule.fingerprint,
            "digest": self.digest,
            "schedule": summary(self.schedule),
            "step": self.step_count,
            "param_steps": logical.export_steps(self),
            "hyperparameters": asdict(self.hp),
            "param_groups": self._saved_groups(),
            "ep_experts": logical.ep_experts(self),
            "tensors": logical.export_state(self, writers_only=False, clone=True),
        })

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore logical state (one `state_dict()`, or several merged with
        `canzona.runtime.state.checkpoint.merge_state_dicts`) saved under any schedule of the same
        model, and the groups' hyperparameters (the groups must list the same parameters).
        ValueError, with nothing changed, if it is another model's or lacks what this rank
        holds. Missing main copies are rebuilt from the parameters at the next step."""
        self.finish_gather()
        state = state_dict
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a canzona optimizer state (format {found!r}, expected {STATE_FORMAT!r}); "
                             f"{logical.UNSUPPORTED_STATE.removeprefix('canzona: ')}")
        problems = incompatibilities(StateLayout.from_json(state["layout"]), self.state_layout())
        if problems:
            raise ValueError("the optimizer state does not fit this model: " + "; ".join(problems))
        groups = logical.check_groups(self, state.get("param_groups"), state.get("ep_experts", ()))
        tensors = state["tensors"]
        dest = logical.plan_import(self, {key: tuple(value.size) for key, value in tensors.items()})
        logical.fill_from(dest, tensors)
        logical.install(self, dest, int(state["step"]), state.get("param_steps", {}))
        logical.restore_groups(self, groups)
