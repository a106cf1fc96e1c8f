"""`FsdpOptimizer`: execute an FSDP schedule (`canzona plan --fsdp`) on a model sharded by FSDP2's
`fully_shard` (and HSDP, and DTensor TP under FSDP2).

FSDP2 has already reduce-scattered (and, for HSDP, all-reduced over the replicas) every
gradient, so each device holds its piece of every matrix's mean gradient: its FSDP chunk of
dim 0 of its TP shard. For each micro-group of the schedule, one fused all-to-all over the
fragmentation group (DP shard x TP devices of a replica) sends every piece to its matrix's host,
the host runs Muon / Shampoo / SOAP on the whole matrix, and one fused all-to-all sends each
device its piece of the update, which it applies to its own shard. The next group's gather is in
flight while a host computes. AdamW parameters are updated where they lie, element-wise. HSDP
replicas execute the same plan on their own fragmentation groups (same gradients, same result).

The geometry (who holds which rows, who sends what) is `canzona.schedules.fsdp`, the one the
planner priced the schedule with; `FragmentGeometry` hands it to the micro-group pipeline
`CanzonaOptimizer` runs over TP (`canzona.runtime.exchange.pipeline`). The formulas are
`canzona.runtime.rules.optimizers`, the ones of `CanzonaOptimizer` and the single-process
reference.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from canzona.runtime.exchange.pipeline import MicroGroupPipeline
from canzona.runtime.faults import StepFailedError, as_timedelta, first_line, gather_objects, settle, wait
from canzona.runtime.groups import group_hyperparameters, listed, resolve_param_groups
from canzona.runtime.rules.optimizers import (
    Hyperparameters,
    MatrixRule,
    adamw_,
    apply_update,
    init_matrix_state,
    make_rule,
    matrix_update_batch,
    stack_limit,
)
from canzona.runtime.schedule import load_schedule, plan_digest, raise_disagreement, tp_shard, verdict_on
from canzona.runtime.update import BatchKey, batch_key
from canzona.schedules.format import ParamEntry, Schedule, ScheduleError
from canzona.schedules.fsdp import FsdpLayout, sends_to_host, shard_numel, shard_shape
from canzona.schedules.geometry import fsdp_rows
from canzona.schedules.layout import Task
from canzona.schedules.limits import FSDP, MATRIX


@dataclass(frozen=True)
class Place:
    """Where this device sits: the layout, its replica and its fragment rank."""

    layout: FsdpLayout
    replica: int
    fragment: int


class FragmentGeometry:
    """The fragmentation group of one replica, as the micro-group pipeline sees it: fragment
    rank f holds its FSDP rows of its TP shard (f mod TP) of every matrix; the host gathers the
    pieces it needs (`sends_to_host`) and assembles the whole matrix."""

    def __init__(self, layout: FsdpLayout, fragment: int) -> None:
        self.layout, self.rank, self.size = layout, fragment, layout.hosts

    def updates(self, task: Task, rank: int) -> bool:
        """Its host."""
        return task.host == rank

    def _shape(self, task: Task, fragment: int) -> tuple[int, ...]:
        return shard_shape(task.shape, task.tp_dim, self.layout, fragment)

    def gather_numel(self, task: Task, sender: int, receiver: int) -> int:
        """The sender's whole piece, if the host needs it."""
        tp = self.layout.tp
        needed = receiver == task.host and (sender == receiver or sends_to_host(task.tp_dim, sender, receiver, tp))
        return shard_numel(task.shape, task.tp_dim, self.layout, sender) if needed else 0

    def gather_piece(self, task: Task, grad: Tensor, receiver: int) -> Tensor:
        """This device's whole piece."""
        return grad

    def assemble(
        self,
        task: Task,
        pieces: Sequence[Tensor],
        grad_of: Callable[[Task], Tensor],
        dtype: torch.dtype,
        device: torch.device,
    ) -> Tensor:
        """The FSDP rows of each TP shard stacked, the TP shards concatenated (a replicated
        matrix: the host's TP column only)."""
        layout = self.layout
        columns = range(layout.tp) if task.tp_dim is not None else [self.rank % layout.tp]
        senders = [[shard * layout.tp + column for shard in range(layout.shards)] for column in columns]
        parts = [torch.cat([pieces[s].view(self._shape(task, s)) for s in column]) for column in senders]
        return parts[0] if task.tp_dim is None else torch.cat(parts, dim=task.tp_dim)

    def scatter_numel(self, task: Task, sender: int, receiver: int) -> int:
        """The receiver's piece, from the host."""
        return shard_numel(task.shape, task.tp_dim, self.layout, receiver) if sender == task.host else 0

    def scatter_piece(self, task: Task, result: Tensor, receiver: int) -> Tensor:
        """The receiver's FSDP rows of its TP shard of the whole update."""
        layout = self.layout
        local = tp_shard(result, task.tp_dim, layout.tp, receiver % layout.tp)
        start, stop = fsdp_rows(local.shape[0], layout.shards)[layout.shard_of(receiver)]
        return local[start:stop]

    def received(self, task: Task, pieces: Sequence[Tensor], dtype: torch.dtype, device: torch.device) -> Tensor:
        """The host's piece, in this device's shape."""
        return pieces[task.host].view(self._shape(task, self.rank))


def _mesh_of(params: list[tuple[str, Tensor]]) -> Any:
    """The parameters' widest DeviceMesh: under TP, parameters the TP plan leaves alone are
    sharded by FSDP2 on its DP mesh only, a sub-mesh of the (dp, tp) one."""
    meshes = [tensor.device_mesh for _, tensor in params if isinstance(tensor, DTensor)]
    return max(meshes, key=lambda mesh: mesh.ndim, default=None)


def mesh_place(mesh: Any, schedule: Schedule) -> tuple[Place | None, str | None]:
    """This device's place in the FSDP layout of `schedule`, from the DeviceMesh the parameters
    live on: dims (replicate, shard, tp), those of size 1 left out. (None, problem) if the mesh
    does not have the schedule's sizes."""
    req = schedule.request
    layout = FsdpLayout.of(req.tp, req.dp, req.dp_replicate)
    expected = [
        size
        for size, kept in ((layout.replicas, layout.replicas > 1), (layout.shards, True), (layout.tp, layout.tp > 1))
        if kept
    ]
    if mesh is None:
        return None, (
            "no parameter is a DTensor: shard the model with FSDP2's fully_shard first (a replicated model "
            "takes CanzonaOptimizer and a schedule planned without --fsdp)"
        )
    if mesh.mesh.numel() != dist.get_world_size():
        return None, (
            f"the parameters' device mesh holds {mesh.mesh.numel()} ranks, but FsdpOptimizer needs one that "
            f"spans every rank of the job ({dist.get_world_size()})"
        )
    if list(mesh.shape) != expected:
        names = f" {tuple(mesh.mesh_dim_names)}" if mesh.mesh_dim_names else ""
        return None, (
            f"the parameters' device mesh{names} has shape {list(mesh.shape)}, but the schedule is for "
            f"{_layout_text(layout)}: mesh (replicate, shard, tp) {expected}"
        )
    coordinate = list(mesh.get_coordinate())
    replica = coordinate[0] if layout.replicas > 1 else 0
    shard = coordinate[1 if layout.replicas > 1 else 0]
    tp_rank = coordinate[-1] if layout.tp > 1 else 0
    return Place(layout, replica, shard * layout.tp + tp_rank), None


def _layout_text(layout: FsdpLayout) -> str:
    hsdp = f"HSDP {layout.replicas} x " if layout.replicas > 1 else "FSDP "
    return f"{hsdp}{layout.shards} shards x TP {layout.tp}"


def _tensor_problem(entry: ParamEntry, tensor: Tensor, place: Place) -> str | None:
    if not isinstance(tensor, DTensor):
        return f"{entry.name}: not a DTensor (not sharded by fully_shard)"
    expected = shard_shape(entry.shape, entry.tp_dim, place.layout, place.fragment)
    local = tuple(tensor.to_local().shape)
    if tuple(tensor.shape) != tuple(entry.shape) or local != expected:
        return (
            f"{entry.name}: global shape {list(tensor.shape)}, local shard {list(local)}; the schedule expects "
            f"{entry.shape} with local shard {list(expected)} (tp_dim {entry.tp_dim}, {_layout_text(place.layout)})"
        )
    return None


def local_problems(schedule: Schedule, pairs: list[tuple[str, Tensor]], place: Place | None) -> list[str]:
    """What does not fit on this rank: the sharding mode, unsupported entries, the tensors."""
    req = schedule.request
    if req.sharding != FSDP:
        return [
            f"the schedule was planned without --fsdp (sharding {req.sharding}), but FsdpOptimizer executes FSDP2 "
            "schedules: plan with `canzona plan ... --fsdp` (or use CanzonaOptimizer for replicated parameters)"
        ]
    unsupported = next((e for e in schedule.params if e.param is not None or e.grad_reduce is not None), None)
    if unsupported is not None:
        what = "grouped expert tensors" if unsupported.param is not None else "gradients partial over TP (grad_reduce)"
        return [f"{what} ({unsupported.name!r}) are not yet executed under FSDP"]
    if place is None:
        return []
    entries = {e.name: e for e in schedule.params}
    found = (_tensor_problem(entries[name], tensor, place) for name, tensor in pairs if name in entries)
    return [problem for problem in found if problem][:4]


def _world() -> dist.ProcessGroup:
    """The job's default process group (FsdpOptimizer runs under an initialised torch.distributed)."""
    world = dist.group.WORLD
    assert world is not None, "torch.distributed is not initialised"
    return world


def _agree_on(schedule: Schedule | None, problem: str | None, frozen: str | None = None) -> None:
    """Every rank's verdict over the whole job; the same ScheduleMismatchError on every rank
    if any rank has a problem, or the ranks hold different schedules or freeze different
    parameters (their micro-groups would then differ)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tp = schedule.request.tp if schedule is not None else 1
    verdict = verdict_on(schedule, rank, rank // tp, rank % tp, problem, frozen=frozen)
    flat = gather_objects(verdict, [_world()], "the FSDP schedule check")
    raise_disagreement([flat[start : start + tp] for start in range(0, world, tp)] if world % tp == 0 else [flat])


class FsdpOptimizer(torch.optim.Optimizer):
    """Muon / Shampoo / SOAP (and AdamW) for an FSDP2-sharded model, executing an FSDP schedule.

    `params`: `model.named_parameters()` or groups of (name, tensor) pairs, as for
    `CanzonaOptimizer` (the names are the schedule's). `schedule`: a `Schedule`, a file or a
    library name, planned with `--fsdp`. `mesh`: the DeviceMesh the parameters live on (default:
    the DTensor parameters' widest), dims (replicate, shard, tp) with those of size 1 left out.
    `timeout` (seconds) bounds every collective of the fragmentation groups. Hyperparameters as
    for `CanzonaOptimizer`. A mismatch between model, mesh and schedule raises the same
    ScheduleMismatchError on every rank."""

    def __init__(
        self,
        params: Iterable[Any],
        schedule: Schedule | str | os.PathLike[str],
        *,
        mesh: Any = None,
        timeout: float | timedelta | None = None,
        **defaults: Any,
    ) -> None:
        self.timeout = as_timedelta(timeout)
        try:
            self.schedule = schedule if isinstance(schedule, Schedule) else load_schedule(schedule)
        except ScheduleError as error:  # a file missing or broken on some ranks only: all of them raise
            _agree_on(None, str(error))
            raise
        self.rule_name = self.schedule.request.optimizer.name
        self.hp = Hyperparameters.from_kwargs(defaults).resolved(self.schedule.request.optimizer)
        entries = {e.name: e for e in self.schedule.params}
        resolved = resolve_param_groups(list(params), entries, 1, self.rule_name, self.hp, fsdp=True)
        pairs = [pair for group in resolved.groups for pair in group["params"]]
        mesh = mesh if mesh is not None else _mesh_of(pairs)
        place, mesh_problem = mesh_place(mesh, self.schedule)
        problems = (
            resolved.problems + ([mesh_problem] if mesh_problem else []) + local_problems(self.schedule, pairs, place)
        )
        _agree_on(self.schedule, listed(problems, "; ") or None, ", ".join(resolved.frozen) or None)
        assert place is not None
        self.place = place
        self.group = self._fragmentation_group(mesh)
        super().__init__(resolved.groups, {"lr": self.hp.lr, "weight_decay": self.hp.weight_decay})
        self.device = pairs[0][1].device if pairs else torch.device("cpu")
        self.names = [name for name, _ in pairs]
        self.tensors = [tensor for _, tensor in pairs]
        position = {name: index for index, name in enumerate(self.names)}
        self.group_of = [index for index, group in enumerate(self.param_groups) for _ in group["params"]]
        self.matrix = [entries[name].optimizer == MATRIX for name in self.names]
        layout = place.layout
        micro_groups = [
            tuple(
                Task(
                    position[n],
                    h,
                    (entries[n].shape[0], entries[n].shape[1]),
                    entries[n].tp_dim,
                    layout.tp,
                    entries[n].row_blocks,
                )
                for n, h in zip(group.params, group.hosts)
                if n in position
            )
            for group in self.schedule.tp.ranks[0].groups
        ]
        self.pipeline = MicroGroupPipeline(
            micro_groups, FragmentGeometry(layout, place.fragment), self.group, self.device, self.timeout, "FSDP"
        )
        self._problem: str | None = None  # the first failure of the step in progress
        self._failed: str | None = None  # a step failed after hosts changed state: load a state first
        for tensor in self.tensors:
            self.state[tensor]["step"] = 0
            if tensor.dtype != torch.float32:
                self.state[tensor]["main"] = tensor.to_local().detach().to(torch.float32).clone()

    # -----------------------------------------------------------------------------------------
    # Construction: one verdict for every rank, the fragmentation groups

    def _fragmentation_group(self, mesh: Any) -> dist.ProcessGroup:
        """The devices of this replica (every rank creates every replica's group, in order)."""
        rows = mesh.mesh.reshape(self.place.layout.replicas, self.place.layout.hosts).tolist()
        return [dist.new_group(ranks, timeout=self.timeout) for ranks in rows][self.place.replica]

    # -----------------------------------------------------------------------------------------
    # The step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One step of every parameter with a gradient (the same ones on every rank). Hosts
        update their matrices' state in place; if a host fails, every rank raises the same
        `StepFailedError` at the end of the step, with no parameter changed, and the optimizer
        refuses to step until a state is loaded (`load_state_dict`)."""
        if self._failed:
            raise StepFailedError(f"canzona: {self._failed}; load the optimizer state before stepping again")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        active = self._active()
        hps = [group_hyperparameters(group, self.hp, self.rule_name) for group in self.param_groups]
        self._problem = None
        received = self._step_matrices(active, hps)
        try:
            settle(
                self._problem,
                [_world()],
                self.timeout,
                "the end of the FSDP step",
                "an FSDP optimizer step failed on some ranks, and no rank applied it (hosted matrices' state may "
                "have changed)",
                self.device,
            )
        except StepFailedError as error:
            self._failed = str(error).removeprefix("canzona: ")
            raise
        for position in (p for p, on in enumerate(active) if on):
            self.state[self.tensors[position]]["step"] += 1
        self._apply(received, hps)
        self._step_adamw(active, hps)
        return loss

    def _active(self) -> list[bool]:
        """Which parameters have a gradient, agreed by every rank (FSDP2 gives every rank the
        same ones; a disagreement raises on every rank instead of hanging)."""
        flags = torch.tensor(
            [tensor.grad is not None for tensor in self.tensors], dtype=torch.int32, device=self.device
        )
        total = flags.clone()
        wait(dist.all_reduce(total, group=dist.group.WORLD, async_op=True), self.timeout, "the FSDP gradient check")
        world = dist.get_world_size()
        if bool(((total != 0) & (total != world)).any()):
            split = [self.names[i] for i in range(len(self.names)) if 0 < int(total[i]) < world]
            raise StepFailedError(
                f"canzona: some ranks have gradients of {', '.join(split[:3])} and others not; no rank stepped"
            )
        return [bool(flag) for flag in total.tolist()]

    def _value(self, position: int) -> Tensor:
        """The fp32 values this device updates: its local shard, or its fp32 main copy."""
        tensor = self.tensors[position]
        state = self.state[tensor]
        return state["main"] if "main" in state else tensor.to_local()

    def _commit(self, position: int) -> None:
        state = self.state[self.tensors[position]]
        if "main" in state:
            self.tensors[position].to_local().copy_(state["main"])

    def _grad(self, position: int) -> Tensor:
        grad = self.tensors[position].grad
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        return local.to(torch.float32)

    def _step_adamw(self, active: list[bool], hps: list[Hyperparameters]) -> None:
        for position, tensor in enumerate(self.tensors):
            if self.matrix[position] or not active[position]:
                continue
            state, value = self.state[tensor], self._value(position)
            if "exp_avg" not in state:
                state["exp_avg"] = torch.zeros(value.numel(), dtype=torch.float32, device=self.device)
                state["exp_avg_sq"] = torch.zeros(value.numel(), dtype=torch.float32, device=self.device)
            if value.numel():
                adamw_(
                    value.view(-1),
                    self._grad(position).reshape(-1),
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    state["step"],
                    hps[self.group_of[position]],
                )
                self._commit(position)

    def _step_matrices(self, active: list[bool], hps: list[Hyperparameters]) -> list[tuple[Task, Tensor]]:
        """Gather, update on the hosts and scatter every micro-group (the shared pipeline);
        this device's update pieces, not applied yet."""
        received: list[tuple[Task, Tensor]] = []
        # on one device the pipeline hands the gradient itself to the update, which uses it as scratch
        copy = self.pipeline.geometry.size == 1
        self.pipeline.run(
            lambda task: self._grad(task.param).clone() if copy else self._grad(task.param),
            lambda tasks, full: self._host_updates(tasks, full, hps),
            lambda task, piece: received.append((task, piece)),
            lambda task: active[task.param],
        )
        return received

    def _host_updates(
        self, tasks: Sequence[Task], full: dict[int, Tensor], hps: list[Hyperparameters]
    ) -> dict[int, Tensor]:
        """The update of every matrix this device hosts, from its whole gradient (scratch):
        matrices of one param group, shape and row blocks updated as one batch
        (`matrix_update_batch`), their state in place."""
        batches: dict[BatchKey, list[Task]] = {}
        for task in tasks:
            batches.setdefault(batch_key(self.group_of[task.param], task), []).append(task)
        for batch in batches.values():
            self._host_batch(batch, [full[task.param] for task in batch], hps[self.group_of[batch[0].param]])
        return full

    def _host_batch(self, batch: list[Task], grads: list[Tensor], hp: Hyperparameters) -> None:
        """Turn `grads` (scratch) into the batch's updates, or, once a host failed this step,
        into zero updates that keep the collectives going (the step then fails everywhere)."""
        if self._problem is None:
            try:
                rule: MatrixRule = make_rule(self.rule_name, hp)
                states = [self._matrix_state(task, rule) for task in batch]
                steps = [self.state[self.tensors[task.param]]["step"] + 1 for task in batch]
                matrix_update_batch(
                    rule, states, grads, batch[0].row_blocks, steps, stack_limit(self.schedule.request.group_bytes)
                )
                return
            except Exception as error:
                self._problem = f"updating {self.names[batch[0].param]}: {first_line(error)}"
        for grad in grads:
            grad.zero_()

    def _matrix_state(self, task: Task, rule: MatrixRule) -> list[Any]:
        state = self.state[self.tensors[task.param]]
        if "matrix" not in state:
            state["matrix"] = init_matrix_state(rule, task.shape, task.row_blocks, self.device)
        return state["matrix"]

    def _apply(self, received: list[tuple[Task, Tensor]], hps: list[Hyperparameters]) -> None:
        """Apply this device's pieces of the updates to its shards."""
        for task, piece in received:
            value = self._value(task.param)
            hp = hps[self.group_of[task.param]]
            apply_update(value, piece.view(value.shape), hp.lr, hp.weight_decay)
            self._commit(task.param)

    # -----------------------------------------------------------------------------------------
    # Checkpoints: the same layout only

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict of this device, tagged with the plan and its place."""
        out = super().state_dict()
        out["canzona_fsdp"] = {"digest": plan_digest(self.schedule), "fragment": self.place.fragment}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by the same device under the same schedule; ValueError for
        another schedule or another place (resharding FSDP optimizer state is not supported)."""
        state_dict = dict(state_dict)
        tag = state_dict.pop("canzona_fsdp", None)
        expected = {"digest": plan_digest(self.schedule), "fragment": self.place.fragment}
        if tag != expected:
            raise ValueError(
                "canzona: this optimizer state was saved under another FSDP schedule or by another device "
                "(FsdpOptimizer loads only the layout it saved; resharding FSDP optimizer state is not supported)"
            )
        problem = self._unsteppable(state_dict)
        if problem:
            raise ValueError(f"canzona: this optimizer state cannot be stepped: {problem} (nothing was loaded)")
        super().load_state_dict(state_dict)
        self._failed = None

    def _unsteppable(self, state_dict: dict[str, Any]) -> str | None:
        """Why `state_dict` (torch's form) would not give every parameter the state a step reads:
        its state keyed by this optimizer's parameter indices, each with an integer `step` (and
        the fp32 main copy of a low-precision parameter); None when it would."""
        state, groups = state_dict.get("state"), state_dict.get("param_groups")
        if not isinstance(state, dict) or not isinstance(groups, list):
            return "it has no 'state' and 'param_groups' (torch's optimizer state dict form)"
        indices = [index for group in groups if isinstance(group, dict) for index in group.get("params", ())]
        stray = [key for key in state if key not in indices]
        if len(indices) != len(self.tensors) or stray:
            return (
                (
                    f"its state is keyed by {', '.join(map(repr, stray[:3]))}, not by the indices of its param groups "
                    "(a state dict another tool rewrote?)"
                )
                if stray
                else f"it lists {len(indices)} parameters, not {len(self.tensors)}"
            )
        for index, (name, tensor) in zip(indices, zip(self.names, self.tensors)):
            entry = state.get(index)
            if (
                not isinstance(entry, dict)
                or isinstance(entry.get("step"), bool)
                or not isinstance(entry.get("step"), int)
            ):
                return f"{name} has no integer 'step'"
            if tensor.dtype != torch.float32 and "main" not in entry:
                return f"{name} has no fp32 main copy ('main')"
        return None
