"""The baselines canzona is measured against (docs/concepts.md), behind the same API and math.

- `TpScOptimizer` (TP-SC): canzona's DP partition (reduce-scatter at the schedule's cuts,
  all-gather after), but each owned matrix is all-gathered over TP and every TP rank updates
  the full matrix and keeps its shard: P-fold redundant compute and full-size state.
- `DpScOptimizer` (DP-SC): all-reduce over DP (per bucket, overlapped with backward as DDP
  does), every DP rank updates every parameter (each matrix TP-SC style), no DP all-gather:
  D·P-fold redundant matrix compute.

Both give the same result as `CanzonaOptimizer`, which the tests check.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from canzona.runtime.exchange import comm
from canzona.runtime.layout import Task, owned_tasks
from canzona.runtime.optimizer import CanzonaOptimizer
from canzona.runtime.exchange.pipeline import gather_replicated, replicated_updates


class TpScOptimizer(CanzonaOptimizer):
    """TP-SC: gather every owned matrix on every TP rank and update it there redundantly."""

    strategy = "tp-sc"

    def _setup_matrices(self) -> None:
        self.tasks = owned_tasks(self.schedule, self._ranks, self.ep_rank)
        self._hosted = [t.param for t in self.tasks]

    def _group_tasks(self) -> list[Task]:
        return list(self.tasks)

    def _gather_full(self, tasks: list[Task], shard_of: Callable[[Task], Tensor]) -> dict[int, Tensor]:
        return gather_replicated(tasks, self.tp_group, shard_of, self.device, self.timeout)

    def _writes_matrix(self, param: int) -> bool:
        return self.tp_rank == 0

    def _update_matrices(self, grads: Tensor, values: Tensor, out: Tensor) -> None:
        replicated_updates(
            self.tasks, self.tp_rank, self.tp_size, self.tp_group,
            grad_of=lambda task: self._local(grads, task),
            update_of=self._host_update,
            apply=lambda task, shard: self._apply(values, out, task, shard),
            device=self.device, timeout=self.timeout, active=self._active_task,
        )


class DpScOptimizer(TpScOptimizer):
    """DP-SC: all-reduce gradients over DP and update everything on every rank."""

    strategy = "dp-sc"
    gathers = False

    def _updated_ranks(self) -> list[int]:
        return list(range(self.dp_size))

    def _writes_matrix(self, param: int) -> bool:
        # one replica per matrix: DP rank 0 for a dense one, the expert-DP group's first rank
        # (DP rank = EP rank) for an expert
        return self.tp_rank == 0 and self.dp_rank == (self.ep_rank if self._expert[param] else 0)

    def _writes_adamw(self, replicated: bool) -> bool:
        return self.dp_rank == 0 and super()._writes_adamw(replicated)

    def _publish(self, out: Tensor, active: list[bool]) -> None:
        comm.unpack(self.layout.pieces, out, self._targets(active))
