"""`CanzonaOptimizer`: executes a schedule every step under torch.distributed (DESIGN §7).

One step: pack gradients into the exchange buffer; uneven reduce-scatter over DP (mean); the
TP micro-group pipeline for the matrices this DP rank owns; AdamW on this rank's equal slices;
uneven all-gather of the updated parameter values over DP, written back in place.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.schedules.format import Schedule, ScheduleError
from canzona.runtime import comm
from canzona.runtime.layout import Task, build_dp_layout, micro_groups
from canzona.runtime.optimizers import Hyperparameters, adamw_, apply_update, init_matrix_state, make_rule, matrix_update
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

STATE_FORMAT = "canzona-runtime/1"


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


class CanzonaOptimizer:
    """Canzona's optimizer step for the live, TP-sharded local parameters of this rank.

    `named_parameters` are named as in the schedule, in registration order; `schedule` is a
    `Schedule` or a path. Gradients are this rank's own (not reduced over DP). Construction
    checks the schedule against the model, the groups and the other ranks, and raises
    `ScheduleMismatchError` on every rank if anything differs. Hyperparameters: see
    `canzona.runtime.optimizers.Hyperparameters` (matrix optimizer and settings default to the
    schedule's)."""

    strategy = "canzona"

    def __init__(self, named_parameters: Iterable[tuple[str, Tensor]], schedule: Schedule | str | os.PathLike[str], *,
                 dp_group: dist.ProcessGroup | None = None, tp_group: dist.ProcessGroup | None = None,
                 mesh: Any = None, **hyperparameters: Any) -> None:
        named = list(named_parameters)
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
        self.matrix_state: dict[int, list[dict[str, Any]]] = {}
        self._send = torch.zeros(self.layout.total)
        self._flat_params = [p.detach().view(-1) for p in self.params]
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

    def _updated_ranks(self) -> list[int]:
        """DP ranks whose slices this rank updates (canzona: its own)."""
        return [self.dp_rank]

    def _setup_matrices(self) -> None:
        self.pipeline = MicroGroupPipeline(micro_groups(self.schedule, self.dp_rank), self.tp_rank, self.tp_size, self.tp_group)

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of every parameter."""
        for param in self.params:
            if set_to_none:
                param.grad = None
            elif param.grad is not None:
                param.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step of every parameter (collective: every rank must call it)."""
        self.step_count += 1
        grads = self._reduce_grads()
        values = torch.zeros(self._size)
        for rank in self._ranks:
            comm.pack(self.layout.rank_pieces[rank], self._flat_params, values, self._base)
        self._update_matrices(grads, values)
        self._update_adamw(grads, values)
        self._publish(values)

    def _reduce_grads(self) -> Tensor:
        grads = [None if p.grad is None else p.grad.detach().reshape(-1) for p in self.params]
        comm.pack(self.layout.pieces, grads, self._send)
        return comm.reduce_scatter_mean(self._send, self.layout.sizes, self.dp_rank, self.dp_group)

    def _publish(self, values: Tensor) -> None:
        gathered = comm.all_gather_uneven(values, self.layout.sizes, self.dp_group)
        comm.unpack(self.layout.pieces, gathered, self._flat_params)

    def _local(self, buffer: Tensor, task: Task) -> Tensor:
        start = self._offsets[task.param]
        return buffer[start : start + task.numel].view(task.local_shape)

    def _host_update(self, task: Task, full_grad: Tensor) -> Tensor:
        if task.param not in self.matrix_state:
            self.matrix_state[task.param] = init_matrix_state(self.rule, task.shape, task.row_blocks)
        return matrix_update(self.rule, self.matrix_state[task.param], full_grad, task.row_blocks, self.step_count)

    def _apply(self, values: Tensor, task: Task, shard: Tensor) -> None:
        apply_update(self._local(values, task), shard, self.hp.lr, self.hp.weight_decay)

    def _update_matrices(self, grads: Tensor, values: Tensor) -> None:
        self.pipeline.run(
            grad_of=lambda task: self._local(grads, task),
            update_of=self._host_update,
            apply=lambda task, shard: self._apply(values, task, shard),
        )

    def _update_adamw(self, grads: Tensor, values: Tensor) -> None:
        offset = 0
        for rank in self._ranks:
            start, stop = (s - self._base for s in self.layout.adamw_region(rank))
            length = stop - start
            adamw_(values[start:stop], grads[start:stop], self.adamw_state["exp_avg"][offset : offset + length],
                   self.adamw_state["exp_avg_sq"][offset : offset + length], self.step_count, self.hp)
            offset += length

    def state_dict(self) -> dict[str, Any]:
        """This rank's optimizer state (its hosted matrices and AdamW slices), with the plan it
        belongs to; load it into an optimizer built from the same schedule at the same rank."""
        return {
            "format": STATE_FORMAT,
            "strategy": self.strategy,
            "digest": self.digest,
            "dp_rank": self.dp_rank,
            "tp_rank": self.tp_rank,
            "step": self.step_count,
            "hyperparameters": asdict(self.hp),
            "matrix": {self.names[index]: copy.deepcopy(state) for index, state in self.matrix_state.items()},
            "adamw": {key: value.clone() for key, value in self.adamw_state.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict()` of the same strategy, schedule and rank (ValueError otherwise)."""
        expected = {"format": STATE_FORMAT, "strategy": self.strategy, "digest": self.digest, "dp_rank": self.dp_rank, "tp_rank": self.tp_rank}
        for key, value in expected.items():
            if state.get(key) != value:
                raise ValueError(f"optimizer state does not belong here: {key} is {state.get(key)!r}, expected {value!r}")
        positions = {name: index for index, name in enumerate(self.names)}
        self.step_count = int(state["step"])
        self.matrix_state = {positions[name]: copy.deepcopy(value) for name, value in state["matrix"].items()}
        self.adamw_state = {key: value.clone() for key, value in state["adamw"].items()}
