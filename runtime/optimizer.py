"""`CanzonaOptimizer`: executes a schedule every step under torch.distributed (DESIGN §7).

One step: pack gradients into the exchange buffer; uneven reduce-scatter over DP (mean); the
TP micro-group pipeline for the matrices this DP rank owns; AdamW on this rank's equal slices;
uneven all-gather of the updated parameter values over DP, written back in place.

A step is a transaction: updates and new state are computed into scratch, every rank agrees
that nobody failed (a safe point before the first collective and one before applying), and
only then are parameters and state replaced. A failure anywhere raises `StepFailedError` on
every rank and changes nothing; a collective that fails or times out raises `CollectiveError`.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.hooks import RemovableHandle

from canzona.schedules.format import Schedule, ScheduleError
from canzona.schedules.reshard import StateLayout, incompatibilities, state_layout
from canzona.runtime import comm, state as logical
from canzona.runtime.faults import CollectiveError, as_timedelta, settle
from canzona.runtime.layout import Task, build_dp_layout, matrix_tasks, micro_groups
from canzona.runtime.optimizers import Hyperparameters, State, adamw_, apply_update, init_matrix_state, make_rule, matrix_update
from canzona.runtime.pipeline import MicroGroupPipeline
from canzona.runtime.schedule import (
    Verdict,
    agree,
    layout_problem,
    load_schedule,
    model_problems,
    plan_digest,
    summary,
)

STATE_FORMAT = "canzona-logical/1"
StepHook = Callable[["CanzonaOptimizer"], None]


def make_groups(dp: int, tp: int, timeout: timedelta | None = None) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's DP and TP groups under canzona's layout, global rank = dp_rank · tp +
    tp_rank. Every rank must call it (new_group needs every rank to create every group, in
    the same order); `timeout` bounds each group's collectives (None: the default)."""
    if dp * tp != dist.get_world_size():
        raise ValueError(f"dp {dp} x tp {tp} does not match the world size {dist.get_world_size()}")
    rank, options = dist.get_rank(), ({"timeout": timeout} if timeout is not None else {})
    dp_group = tp_group = None
    for t in range(tp):
        group = dist.new_group([d * tp + t for d in range(dp)], **options)
        dp_group = group if rank % tp == t else dp_group
    for d in range(dp):
        group = dist.new_group([d * tp + t for t in range(tp)], **options)
        tp_group = group if rank // tp == d else tp_group
    assert dp_group is not None and tp_group is not None
    return dp_group, tp_group


def resolve_groups(dp_group: Any, tp_group: Any, mesh: Any) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The DP and TP process groups, from explicit groups or a 2-D DeviceMesh (axes dp, tp)."""
    if mesh is not None:
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if mesh.ndim != 2 or set(names) != {"dp", "tp"}:
            raise ValueError(f"the device mesh must be 2-D with dims named 'dp' and 'tp', got {names or mesh.ndim}")
        return mesh.get_group("dp"), mesh.get_group("tp")
    if dp_group is None or tp_group is None:
        raise TypeError("CanzonaOptimizer needs dp_group and tp_group (or mesh=DeviceMesh with dims dp, tp)")
    return dp_group, tp_group


def _problem(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


@dataclass
class _Pending:
    """What one step has computed but not applied."""

    step: int
    problem: str | None = None
    matrix: dict[int, list[State]] = field(default_factory=dict)
    adamw: dict[str, Tensor] | None = None

    def fail(self, problem: str) -> None:
        """Record the first problem of the step."""
        self.problem = self.problem or problem


class CanzonaOptimizer:
    """Canzona's optimizer step for the live, TP-sharded local parameters of this rank.

    `named_parameters` are named as in the schedule, in registration order; `schedule` is a
    `Schedule` or a path. Gradients are this rank's own (not reduced over DP). Construction
    checks the schedule against the model, the groups and the other ranks, and raises
    `ScheduleMismatchError` on every rank if anything differs. `timeout` (seconds or a
    timedelta) bounds every collective of a step (None: the process groups' own timeout);
    `check_finite` makes a non-finite local gradient fail the step on every rank.
    `dp_collectives`: "all_to_all" (default: one fused all_to_all each way, summed in rank
    order, so results match the single-process reference bit for bit in order; a slice's
    owner receives n − 1 copies) or "rooted" (one reduce to and one broadcast from each
    slice's owner: every link carries a slice about once however uneven the cuts are; the
    backend's summation order differs, which Shampoo/SOAP amplify beyond rtol 1e-5 at DP 4).
    Hyperparameters: see `canzona.runtime.optimizers.Hyperparameters` (matrix optimizer and
    settings default to the schedule's)."""

    strategy = "canzona"

    def __init__(self, named_parameters: Iterable[tuple[str, Tensor]], schedule: Schedule | str | os.PathLike[str], *,
                 dp_group: dist.ProcessGroup | None = None, tp_group: dist.ProcessGroup | None = None,
                 mesh: Any = None, timeout: float | timedelta | None = None, check_finite: bool = False,
                 dp_collectives: str = "all_to_all", **hyperparameters: Any) -> None:
        named = list(named_parameters)
        if dp_collectives not in comm.DP_COLLECTIVES:
            raise ValueError(f"dp_collectives must be one of {', '.join(comm.DP_COLLECTIVES)}, got {dp_collectives!r}")
        self.rooted = dp_collectives == "rooted"
        self.timeout = as_timedelta(timeout)
        self.check_finite = check_finite
        self.dp_group, self.tp_group = resolve_groups(dp_group, tp_group, mesh)
        self.dp_size, self.dp_rank = dist.get_world_size(self.dp_group), dist.get_rank(self.dp_group)
        self.tp_size, self.tp_rank = dist.get_world_size(self.tp_group), dist.get_rank(self.tp_group)
        loaded, problem = self._prepare(named, schedule, hyperparameters)
        verdict = Verdict(
            rank=dist.get_rank(), dp_rank=self.dp_rank, tp_rank=self.tp_rank, problem=problem,
            fingerprint=loaded.fingerprint if loaded else None,
            digest=plan_digest(loaded) if loaded else None,
            summary=summary(loaded) if loaded else "no schedule",
        )
        agree(verdict, self.dp_group, self.tp_group)
        assert loaded is not None and verdict.digest is not None
        self.schedule: Schedule = loaded
        self.digest: str = verdict.digest
        self.params = [tensor for _, tensor in named]
        self.names = [name for name, _ in named]
        self._hooks: OrderedDict[int, StepHook] = OrderedDict()  # RemovableHandle needs a weak reference
        self._broken: str | None = None
        self._pending: _Pending | None = None
        self._setup()

    def _prepare(self, named: list[tuple[str, Tensor]], schedule: Schedule | str | os.PathLike[str],
                 hyperparameters: dict[str, Any]) -> tuple[Schedule | None, str | None]:
        """Load and check locally; every failure becomes this rank's verdict, not an exception."""
        try:
            loaded = schedule if isinstance(schedule, Schedule) else load_schedule(schedule)
        except ScheduleError as error:
            return None, str(error)
        try:
            self.hp = Hyperparameters.from_kwargs(hyperparameters).resolved(loaded.request.optimizer)
        except (TypeError, ValueError) as error:
            return loaded, f"bad hyperparameters: {error}"
        problems = [p for p in [layout_problem(loaded, self.dp_size, self.tp_size)] if p]
        problems += model_problems(loaded, named)
        if problems:
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            return loaded, "model does not match the schedule: " + "; ".join(problems[:3]) + more
        return loaded, None

    def _setup(self) -> None:
        self.layout = build_dp_layout(self.schedule)
        self.rule = make_rule(self.schedule.request.optimizer.name, self.hp)
        self.step_count = 0
        self.matrix_state: dict[int, list[State]] = {}
        self._send = torch.zeros(self.layout.total)
        self._flat_params = [p.detach().view(-1) for p in self.params]
        self._tp_dims = [e.tp_dim for e in sorted(self.schedule.params, key=lambda e: e.index)]
        self._ranks = self._updated_ranks()
        self._base = self.layout.starts[self._ranks[0]]
        self._size = sum(self.layout.sizes[r] for r in self._ranks)
        matrix_end = {r: self.layout.starts[r] + self.layout.matrix_sizes[r] for r in self._ranks}
        self._offsets = {  # owned matrices are one piece each, inside the matrix part of a slice
            p.param: p.dst - self._base for r in self._ranks for p in self.layout.rank_pieces[r] if p.dst < matrix_end[r]
        }
        adamw = sum(self.layout.sizes[r] - self.layout.matrix_sizes[r] for r in self._ranks)
        self.adamw_state = {"exp_avg": torch.zeros(adamw), "exp_avg_sq": torch.zeros(adamw)}
        self._setup_matrices()
        hosted = set(self._hosted)
        self._tasks: dict[int, Task] = {t.param: t for t in matrix_tasks(self.schedule).values() if t.param in hosted}

    def _updated_ranks(self) -> list[int]:
        """DP ranks whose slices this rank updates (canzona: its own)."""
        return [self.dp_rank]

    def _setup_matrices(self) -> None:
        groups = micro_groups(self.schedule, self.dp_rank)
        self.pipeline = MicroGroupPipeline(groups, self.tp_rank, self.tp_size, self.tp_group, self.timeout)
        self._hosted = [t.param for tasks in groups for t in tasks if t.host == self.tp_rank]

    def _writes_matrix(self) -> bool:
        """Whether this rank saves the matrix state it holds (one copy of each replica)."""
        return True

    def _writes_adamw(self, replicated: bool) -> bool:
        """Whether this rank saves its AdamW state of a parameter (`replicated` over TP)."""
        return not replicated or self.tp_rank == 0

    @cached_property
    def _adamw_runs(self) -> list[logical.AdamwRun]:
        return logical.adamw_runs(self)

    @property
    def hyperparameters(self) -> Hyperparameters:
        """The resolved hyperparameters."""
        return self.hp

    def set_hyperparameters(self, **changes: Any) -> None:
        """Change scalar knobs between steps (e.g. `lr`, `adamw_lr` for a schedule); the ones
        that shape the optimizer state (block size, max precondition dim) cannot change."""
        fixed = sorted({"block_size", "max_precond_dim"} & set(changes))
        if fixed:
            raise ValueError(f"{', '.join(fixed)} shape the optimizer state and cannot change mid-run")
        hp = Hyperparameters.from_kwargs({**asdict(self.hp), **changes})
        hp.check()
        self.hp, self.rule = hp, make_rule(self.schedule.request.optimizer.name, hp)

    def register_step_pre_hook(self, hook: StepHook) -> RemovableHandle:
        """Run `hook(optimizer)` at the start of every step, before any collective; if it raises
        on any rank, the step fails on every rank (e.g. a custom gradient check)."""
        handle = RemovableHandle(self._hooks)
        self._hooks[handle.id] = hook
        return handle

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter."""
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

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

    def _settle(self, problem: str | None, step: int, before_collectives: bool) -> None:
        where = "before its first collective" if before_collectives else "before applying its update"
        failure = f"step {step} failed {where}, nothing was applied on any rank"
        settle(problem, (self.tp_group, self.dp_group), self.timeout, f"the safe point of step {step} {where}", failure)

    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step of every parameter (collective: every rank must call it).

        Raises `StepFailedError` on every rank if any rank failed (nothing applied anywhere),
        `CollectiveError` if a collective failed or timed out."""
        pending = _Pending(self.step_count + 1)
        with self._collectives():
            self._settle(self._before_step(), pending.step, before_collectives=True)
            grads = self._reduce_grads()
            values = torch.zeros(self._size)
            for rank in self._ranks:
                comm.pack(self.layout.rank_pieces[rank], self._flat_params, values, self._base)
            self._pending = pending
            try:
                self._update_matrices(grads, values)
            finally:
                self._pending = None
            self._update_adamw(grads, values, pending)
            self._settle(pending.problem, pending.step, before_collectives=False)
            self._publish(values)
        self.matrix_state.update(pending.matrix)
        if pending.adamw is not None:
            self.adamw_state = pending.adamw
        self.step_count = pending.step

    def _before_step(self) -> str | None:
        """Local work before the first collective: hooks, packing, the finiteness check."""
        try:
            for hook in list(self._hooks.values()):
                hook(self)
            self._pack_grads()
            if self.check_finite and not bool(torch.isfinite(self._send).all()):
                bad = [n for n, p in zip(self.names, self.params) if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
                return f"non-finite gradient in {', '.join(bad[:3]) or 'the gradient buffer'}"
        except Exception as error:  # noqa: BLE001 - reported to every rank at the safe point
            return _problem(error)
        return None

    def _pack_grads(self) -> None:
        grads = [None if p.grad is None else p.grad.detach().reshape(-1) for p in self.params]
        comm.pack(self.layout.pieces, grads, self._send)

    def _reduce_grads(self) -> Tensor:
        reduce = comm.reduce_scatter_rooted if self.rooted else comm.reduce_scatter_mean
        return reduce(self._send, self.layout.sizes, self.dp_rank, self.dp_group, self.timeout)

    def _publish(self, values: Tensor) -> None:
        gather = comm.all_gather_rooted if self.rooted else comm.all_gather_uneven
        gathered = gather(values, self.layout.sizes, self.dp_group, self.timeout)
        comm.unpack(self.layout.pieces, gathered, self._flat_params)

    def _local(self, buffer: Tensor, task: Task) -> Tensor:
        start = self._offsets[task.param]
        return buffer[start : start + task.numel].view(task.local_shape)

    def _host_update(self, task: Task, full_grad: Tensor) -> Tensor:
        """The update of a hosted matrix, computed on a copy of its state; a failure is
        recorded (and a zero update keeps the collectives going) for the next safe point."""
        pending = self._pending
        assert pending is not None
        if pending.problem is None:
            try:
                current = self.matrix_state.get(task.param)
                states = logical.clone_states(current) if current else init_matrix_state(self.rule, task.shape, task.row_blocks)
                update = matrix_update(self.rule, states, full_grad, task.row_blocks, pending.step)
                pending.matrix[task.param] = states
                return update
            except Exception as error:  # noqa: BLE001
                pending.fail(f"updating {self.names[task.param]}: {_problem(error)}")
        return torch.zeros(task.shape)

    def _apply(self, values: Tensor, task: Task, shard: Tensor) -> None:
        apply_update(self._local(values, task), shard, self.hp.lr, self.hp.weight_decay)

    def _update_matrices(self, grads: Tensor, values: Tensor) -> None:
        self.pipeline.run(
            grad_of=lambda task: self._local(grads, task),
            update_of=self._host_update,
            apply=lambda task, shard: self._apply(values, task, shard),
        )

    def _update_adamw(self, grads: Tensor, values: Tensor, pending: _Pending) -> None:
        try:
            moments = {key: value.clone() for key, value in self.adamw_state.items()}
            offset = 0
            for rank in self._ranks:
                start, stop = (s - self._base for s in self.layout.adamw_region(rank))
                length = stop - start
                adamw_(values[start:stop], grads[start:stop], moments["exp_avg"][offset : offset + length],
                       moments["exp_avg_sq"][offset : offset + length], pending.step, self.hp)
                offset += length
            pending.adamw = moments
        except Exception as error:  # noqa: BLE001
            pending.fail(f"AdamW: {_problem(error)}")

    def state_layout(self) -> StateLayout:
        """What decides the logical state's keys and shapes (model, optimizer, shapes)."""
        return state_layout(self.schedule, block_size=self.hp.block_size, max_precond_dim=self.hp.max_precond_dim)

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state in logical form (`canzona.runtime.state`): full-shape,
        schedule-independent tensors (the chunks this rank holds), the step, the model's state
        layout and the schedule fingerprint. Any optimizer of the same model can load a set of
        these that covers what it holds (`load_state_dict`), whatever its schedule."""
        return {
            "format": STATE_FORMAT,
            "strategy": self.strategy,
            "layout": self.state_layout().to_json(),
            "fingerprint": self.schedule.fingerprint,
            "digest": self.digest,
            "schedule": summary(self.schedule),
            "step": self.step_count,
            "hyperparameters": asdict(self.hp),
            "tensors": logical.export_state(self, writers_only=False, clone=True),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore logical state (one `state_dict()`, or several merged with
        `canzona.runtime.checkpoint.merge_state_dicts`) saved under any schedule of the same
        model. ValueError, with nothing changed, if it is another model's or lacks what this
        rank holds."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            found = state.get("format") if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"not a canzona optimizer state (format {found!r}, expected {STATE_FORMAT!r})")
        problems = incompatibilities(StateLayout.from_json(state["layout"]), self.state_layout())
        if problems:
            raise ValueError("the optimizer state does not fit this model: " + "; ".join(problems))
        tensors = state["tensors"]
        dest = logical.plan_import(self, {key: tuple(value.size) for key, value in tensors.items()})
        logical.fill_from(dest, tensors)
        logical.install(self, dest, int(state["step"]))
