"""The update stage of a step on one rank: host results of the matrices it updates, applying
this rank's shards, and AdamW on its slices. State, main copies and parameters change in place.

Hosts compute a micro-group's matrices by batch: matrices of one param group, shape and row
blocks are updated together (`matrix_update_batch`: Muon orthogonalises each submatrix
position of the batch as one batched product, stacked at most `stack_limit` elements
at a time); a team-hosted matrix is computed with its team (`canzona.runtime.rules.cooperative`).
A matrix's gradient (its place in the bucket buffer, or the matrix the TP gather assembled) is
the scratch its update is computed in: no stage copies the gradients of a whole batch. A host's
result is the fp32 update of an fp32 parameter, or the new value (its fp32 main copy, updated
here) of a bf16/fp16 one; `apply` writes a rank's shard of it into the parameter. AdamW runs on
this rank's slices of the bucket buffer, on the main copies of low-precision parameters and on
fp32 parameters themselves.

A failure inside a host's computation or AdamW (an out-of-memory error, a bad value) is
recorded in the step's `StepContext` and the stage goes on with neutral results (the current
value, a zero update), so every rank finishes the step's collectives; the optimizer then fails
the step on every rank at its next safe point. State changed before the failure stays changed:
such a step leaves the optimizer unusable until a checkpoint is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from canzona.runtime.faults import CollectiveError, first_line
from canzona.runtime.plan import AdamwPiece, RankPlan
from canzona.runtime.rules import cooperative
from canzona.runtime.rules.optimizers import (
    Hyperparameters,
    MatrixRule,
    State,
    adamw_,
    apply_update,
    matrix_update_batch,
    stack_limit,
)
from canzona.runtime.state.store import OptimizerState, matrix_template
from canzona.schedules.layout import Task

BatchKey = tuple[int, tuple[int, int], tuple[tuple[tuple[int, int], ...], ...] | None]


@dataclass
class StepContext:
    """One step as the update stage sees it: its number, which entries take part, every param
    group's hyperparameters and matrix rule, and the first problem met (None: none)."""

    step: int
    active: list[bool]
    hps: list[Hyperparameters]
    rules: dict[int, MatrixRule]
    problem: str | None = None

    def fail(self, problem: str) -> None:
        """Record the first problem of the step."""
        self.problem = self.problem or problem


def batch_key(group: int, task: Task) -> BatchKey:
    """What the matrices updated as one batch share: param group `group`, shape and row blocks."""
    blocks = (
        tuple(tuple((start, stop) for start, stop in block) for block in task.row_blocks) if task.row_blocks else None
    )
    return group, task.shape, blocks


class Updater:
    """The update stage of one rank (module docstring). `team_groups`: the process groups of
    the teams this rank belongs to."""

    def __init__(
        self,
        plan: RankPlan,
        state: OptimizerState,
        team_groups: dict[tuple[int, ...], dist.ProcessGroup],
        timeout: timedelta | None,
    ) -> None:
        self.plan, self.state, self.team_groups, self.timeout = plan, state, team_groups, timeout
        self._batches: dict[tuple[int, ...], list[list[Task]]] = {}

    # -- hosts -------------------------------------------------------------------------------

    def batches(self, tasks: Sequence[Task]) -> list[list[Task]]:
        """`tasks` split into batches computed together (a team's matrix is a batch of its own),
        in order of first appearance; remembered per set of tasks."""
        memo = tuple(t.param for t in tasks)
        found = self._batches.get(memo)
        if found is None:
            grouped: dict[BatchKey | int, list[Task]] = {}
            for task in tasks:
                grouped.setdefault(
                    task.param if task.team else batch_key(self.plan.group_of[task.param], task), []
                ).append(task)
            found = self._batches[memo] = list(grouped.values())
        return found

    def host_results(self, ctx: StepContext, tasks: Sequence[Task], full: dict[int, Tensor]) -> dict[int, Tensor]:
        """The result of every matrix of `tasks` (all updated here), from its full gradient (a
        team member's: its slice)."""
        results: dict[int, Tensor] = {}
        for batch in self.batches(tasks):
            if batch[0].team:
                results[batch[0].param] = self._team_result(ctx, batch[0], full[batch[0].param])
                continue
            try:
                results.update(self._batch_results(ctx, batch, full) if ctx.problem is None else self._neutral(batch))
            except Exception as error:
                ctx.fail(f"updating {self.plan.names[batch[0].param]}: {first_line(error)}")
                results.update(self._neutral(batch))
        return results

    def _states(self, rule: MatrixRule, task: Task) -> list[State]:
        states = self.state.matrix.get(task.param)
        if states is None:
            states = self.state.matrix[task.param] = matrix_template(self.plan, rule, task.param)
        return states

    def _batch_results(self, ctx: StepContext, batch: list[Task], full: dict[int, Tensor]) -> dict[int, Tensor]:
        group = self.plan.group_of[batch[0].param]
        rule, hp = ctx.rules[group], ctx.hps[group]
        states = [self._states(rule, task) for task in batch]
        steps = [self.state.param_steps[task.param] + 1 for task in batch]
        updates = [full[task.param] for task in batch]  # scratch: the gradients become the updates
        matrix_update_batch(
            rule, states, updates, batch[0].row_blocks, steps, stack_limit(self.plan.schedule.request.group_bytes)
        )
        if not self.plan.lowp(batch[0].param):
            return {task.param: update for task, update in zip(batch, updates)}
        mains = [self.state.main.matrices[task.param] for task in batch]
        if hp.weight_decay:
            torch._foreach_mul_(mains, 1 - hp.lr * hp.weight_decay)
        torch._foreach_add_(mains, updates, alpha=-hp.lr)
        return {task.param: main for task, main in zip(batch, mains)}

    def _neutral(self, batch: Sequence[Task]) -> dict[int, Tensor]:
        """Results that change nothing: the current main copy, or a zero update."""
        held = cooperative.held_shape
        return {
            t.param: self.state.main.matrices[t.param]
            if self.plan.lowp(t.param)
            else torch.zeros(held(t, self.plan.place.tp_rank), dtype=torch.float32, device=self.plan.device)
            for t in batch
        }

    def _team_result(self, ctx: StepContext, task: Task, grad: Tensor) -> Tensor:
        """A team member's slice of its matrix's result; after a failure it goes through the
        team's remaining all-reduces on zeros, so the other members finish theirs."""
        group = self.plan.group_of[task.param]
        hp, calls = ctx.hps[group], cooperative.Calls()
        if ctx.problem is None:
            try:
                states = self._states(ctx.rules[group], task)
                update = cooperative.team_muon(
                    hp, states[0], grad.float(), task, self.team_groups[task.team], self.timeout, calls
                )
                if not self.plan.lowp(task.param):
                    return update
                main = self.state.main.matrices[task.param]
                apply_update(main, update, hp.lr, hp.weight_decay)
                return main
            except CollectiveError:
                raise
            except Exception as error:
                ctx.fail(f"updating {self.plan.names[task.param]}: {first_line(error)}")
        cooperative.idle(
            task, self.team_groups[task.team], hp.ns_steps or 0, self.plan.device, self.timeout, calls.count
        )
        return self._neutral([task])[task.param]

    def apply(self, ctx: StepContext, task: Task, shard: Tensor) -> None:
        """Write this rank's shard of a matrix's result into its parameter: the new values of a
        bf16/fp16 matrix, or the fp32 update of an fp32 one (p ← p·(1 − lr·wd) − lr·u)."""
        value = self.plan.value(task.param)
        if self.plan.lowp(task.param):
            value.copy_(shard.view(value.shape))
            return
        hp = ctx.hps[self.plan.group_of[task.param]]
        apply_update(value, shard.view(value.shape), hp.lr, hp.weight_decay)

    # -- AdamW -------------------------------------------------------------------------------

    def _runs(self, ctx: StepContext) -> list[list[int]]:
        """[group, param step, position, state offset, length, piece] of every run of stepped
        AdamW elements: adjacent low-precision pieces (updated on the contiguous main copy)
        that share a group and a step count merge; an fp32 piece (updated in its parameter)
        is a run of its own (piece = its position in `plan.adamw`, -1 for a merged run)."""
        plan = self.plan
        runs: list[list[int]] = []
        for number, piece in enumerate(plan.adamw):
            if not (ctx.active[piece.param] and plan.optimized(piece.param)):
                continue
            key = [plan.group_of[piece.param], self.state.param_steps[piece.param]]
            last = runs[-1] if runs else None
            if (
                plan.lowp(piece.param)
                and last is not None
                and last[5] == -1
                and last[:2] == key
                and last[2] + last[4] == piece.pos
                and last[3] + last[4] == piece.offset
            ):
                last[4] += piece.length
            else:
                runs.append([*key, piece.pos, piece.offset, piece.length, -1 if plan.lowp(piece.param) else number])
        return runs

    def _values(self, run: list[int]) -> Tensor:
        if run[5] == -1:
            assert self.state.main.adamw is not None
            return self.state.main.adamw[run[3] : run[3] + run[4]]
        piece: AdamwPiece = self.plan.adamw[run[5]]
        return self.plan.value(piece.param).view(-1)[piece.src : piece.src + piece.length]

    def adamw(self, ctx: StepContext, send: Tensor) -> None:
        """AdamW on every active piece of this rank's slices (gradients at their positions in
        `send`); low-precision parameters get their new values from their main copies."""
        if ctx.problem is not None:
            return
        moments, main = self.state.adamw, self.state.main.adamw
        try:
            for run in self._runs(ctx):
                group, steps, position, offset, length, _ = run
                grad = send[position : position + length]  # spent once the moments have it: the scratch
                adamw_(
                    self._values(run),
                    grad,
                    moments["exp_avg"][offset : offset + length],
                    moments["exp_avg_sq"][offset : offset + length],
                    steps + 1,
                    ctx.hps[group],
                    scratch=grad,
                )
            for piece in self.plan.adamw:
                if ctx.active[piece.param] and self.plan.optimized(piece.param) and self.plan.lowp(piece.param):
                    assert main is not None
                    flat = self.plan.value(piece.param).view(-1)
                    flat[piece.src : piece.src + piece.length].copy_(main[piece.offset : piece.offset + piece.length])
        except Exception as error:
            ctx.fail(f"AdamW: {first_line(error)}")
