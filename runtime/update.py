"""The update stage of a step (`UpdateStage`, a part of `CanzonaOptimizer`): from this rank's
DP-mean gradients to its new values, computed into scratch (`Transaction`) and applied only
after every rank agreed that nobody failed.

The TP micro-group pipeline updates the matrices this DP rank owns (each on its host, from its
fp32 main copy for a low-precision parameter); AdamW updates this rank's equal slices; the new
values are written into `out` (region coordinates, in the dtype they travel in) for the DP
gather. `_commit` installs what a step computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from canzona.runtime.exchange import comm
from canzona.runtime.rules import cooperative
from canzona.runtime.state import logical
from canzona.runtime.faults import CollectiveError
from canzona.runtime.layout import Task
from canzona.runtime.rules.optimizers import Hyperparameters, MatrixRule, State, adamw_, apply_update, init_matrix_state, make_rule, matrix_update


def problem_line(error: BaseException) -> str:
    """'Type: first line' of an error, for a one-line report."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


@dataclass
class Transaction:
    """What one step has computed but not applied."""

    step: int
    active: list[bool]
    hps: list[Hyperparameters]
    rules: dict[int, MatrixRule]
    problem: str | None = None
    matrix: dict[int, list[State]] = field(default_factory=dict)
    main: dict[int, Tensor] = field(default_factory=dict)
    adamw: dict[str, Tensor] | None = None

    def fail(self, problem: str) -> None:
        """Record the first problem of the step."""
        self.problem = self.problem or problem


class UpdateStage:
    """The update stage's methods; `CanzonaOptimizer` (and the baselines) inherit them and
    provide the attributes they read (layout, buffers, groups, state, the pipeline)."""

    _pending: Transaction | None

    def _group_rule(self, hp: Hyperparameters) -> MatrixRule:
        return make_rule(self.schedule.request.optimizer.name, hp)

    def _update(self, grads: Tensor, pending: Transaction) -> None:
        values = torch.empty(self._size, dtype=torch.float32, device=self.device)
        out = torch.empty(self._size, dtype=self._wire_dtype, device=self.device)
        self._pack_values(values)
        self._pending = pending
        try:
            self._update_matrices(grads, values, out)
        finally:
            self._pending = None
        self._update_adamw(grads, values, pending)
        for start, stop in self._adamw_spans():
            out[start:stop].copy_(values[start:stop])
        self._settle(pending.problem, pending.step, before_collectives=False)
        self._publish(out, pending.active)
        if self.main.adamw is not None:
            offset = 0
            for start, stop in self._adamw_spans():
                self.main.adamw[offset : offset + stop - start].copy_(values[start:stop])
                offset += stop - start

    def _adamw_spans(self) -> list[tuple[int, int]]:
        """[start, stop) of every AdamW region this rank updates, in its buffer coordinates."""
        return [tuple(s - self._base for s in self.layout.adamw_region(r)) for r in self._ranks]  # type: ignore[misc]

    def _pack_values(self, values: Tensor) -> None:
        """Current fp32 values of what this rank updates: main copies of low-precision AdamW
        elements, the parameters themselves for fp32 ones (low-precision matrices come from
        their hosts' main copies)."""
        if self.main.adamw is not None:
            offset = 0
            for start, stop in self._adamw_spans():
                values[start:stop].copy_(self.main.adamw[offset : offset + stop - start])
                offset += stop - start
        comm.pack(self._fp32_pieces, self._flat_params, values, self._base, zero_missing=False)

    def _commit(self, pending: Transaction) -> None:
        self.matrix_state.update(pending.matrix)
        self.main.matrices.update(pending.main)
        if pending.adamw is not None:
            self.adamw_state = pending.adamw
        for index, active in enumerate(pending.active):
            if active and self._counted[index]:
                self.param_steps[index] += 1
        self.step_count = pending.step

    def _local(self, buffer: Tensor, task: Task) -> Tensor:
        start = self._offsets[task.param]
        return buffer[start : start + task.numel].view(task.local_shape)

    def _host_update(self, task: Task, full_grad: Tensor) -> Tensor:
        """The host's result for a matrix (an fp32 update, or the new values in the model dtype
        from its fp32 main copy), computed on copies of its state; a failure is recorded (and a
        zero result keeps the collectives going) for the next safe point."""
        pending = self._pending
        assert pending is not None
        calls = cooperative.Calls()
        if pending.problem is None:
            try:
                return self._matrix_result(task, full_grad, pending, calls)
            except CollectiveError:
                raise
            except Exception as error:  # noqa: BLE001
                pending.fail(f"updating {self.names[task.param]}: {problem_line(error)}")
        if task.team:  # the team's other members are in its all-reduces: go through the rest on zeros
            steps = pending.hps[self._group_of[task.param]].ns_steps or 0
            cooperative.idle(task, self.pipeline.team_groups[task.team], steps, self.device, self.timeout, calls.count)
        return torch.zeros(cooperative.held_shape(task, self.tp_rank), dtype=self._dtypes[task.param], device=self.device)

    def _matrix_result(self, task: Task, full_grad: Tensor, pending: Transaction, calls: cooperative.Calls) -> Tensor:
        group = self._group_of[task.param]
        rule, hp = pending.rules[group], pending.hps[group]
        current = self.matrix_state.get(task.param)
        if task.team:  # this member's slice: its momentum, its part of a shared Newton-Schulz
            states = logical.clone_states(current) if current else [rule.init_state(*cooperative.held_shape(task, self.tp_rank), self.device)]
            update = cooperative.team_muon(hp, states[0], full_grad.float(), task, self.pipeline.team_groups[task.team],
                                           self.timeout, calls)
        else:
            states = logical.clone_states(current) if current else init_matrix_state(rule, task.shape, task.row_blocks, self.device)
            update = matrix_update(rule, states, full_grad, task.row_blocks, self.param_steps[task.param] + 1)
        pending.matrix[task.param] = states
        if not self._lowp[task.param]:
            return update
        main = self.main.matrices[task.param].clone()
        apply_update(main, update, hp.lr, hp.weight_decay)
        pending.main[task.param] = main
        return main.to(self._dtypes[task.param])

    def _apply(self, values: Tensor, out: Tensor, task: Task, shard: Tensor) -> None:
        """Write this rank's shard of a matrix's result into the outgoing buffer."""
        if self._lowp[task.param]:
            self._local(out, task).copy_(shard)
            return
        pending = self._pending
        assert pending is not None
        hp = pending.hps[self._group_of[task.param]]
        value = self._local(values, task)
        apply_update(value, shard, hp.lr, hp.weight_decay)
        self._local(out, task).copy_(value)

    def _active_task(self, task: Task) -> bool:
        pending = self._pending
        return pending is not None and pending.active[task.param] and self._managed[task.param]

    def _update_matrices(self, grads: Tensor, values: Tensor, out: Tensor) -> None:
        self.pipeline.run(
            grad_of=lambda task: self._local(grads, task),
            update_of=self._host_update,
            apply=lambda task, shard: self._apply(values, out, task, shard),
            active=self._active_task,
        )

    def _adamw_runs_now(self, active: list[bool]) -> list[tuple[int, int, int, int, int]]:
        """(group, param step, buffer start, state offset, length) of every contiguous run of
        stepped AdamW elements that share a group and a step count."""
        runs: list[list[int]] = []
        for piece, offset in self._adamw_pieces:
            if not active[piece.param]:
                continue
            key = (self._group_of[piece.param], self.param_steps[piece.param])
            start = piece.dst - self._base
            if runs and (runs[-1][0], runs[-1][1]) == key and runs[-1][2] + runs[-1][4] == start and runs[-1][3] + runs[-1][4] == offset:
                runs[-1][4] += piece.length
            else:
                runs.append([*key, start, offset, piece.length])
        return [tuple(run) for run in runs]  # type: ignore[misc]

    def _update_adamw(self, grads: Tensor, values: Tensor, pending: Transaction) -> None:
        try:
            moments = {key: value.clone() for key, value in self.adamw_state.items()}
            for group, steps, start, offset, length in self._adamw_runs_now(pending.active):
                adamw_(values[start : start + length], grads[start : start + length],
                       moments["exp_avg"][offset : offset + length], moments["exp_avg_sq"][offset : offset + length],
                       steps + 1, pending.hps[group])
            pending.adamw = moments
        except Exception as error:  # noqa: BLE001
            pending.fail(f"AdamW: {problem_line(error)}")

