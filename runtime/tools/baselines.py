"""The baselines canzona is measured against (docs/concepts.md), behind the same API and math.

- `TpScOptimizer` (TP-SC): canzona's DP partition (reduce-scatter at the schedule's cuts,
  all-gather after), but each owned matrix is all-gathered over TP and every TP rank updates
  the full matrix and keeps its shard: P-fold redundant compute and full-size state.
- `DpScOptimizer` (DP-SC): all-reduce over DP (per bucket, overlapped with backward as DDP
  does), every DP rank updates every parameter (each matrix TP-SC style), no DP all-gather:
  D·P-fold redundant matrix compute.

Both are `CanzonaOptimizer` with another `Strategy` (`canzona.runtime.plan`): the same engine,
stages and formulas, so they give the same result, which the tests check.
"""

from __future__ import annotations

from canzona.runtime.optimizer import CanzonaOptimizer
from canzona.runtime.plan import DP_SC, TP_SC


class TpScOptimizer(CanzonaOptimizer):
    """TP-SC: gather every owned matrix on every TP rank and update it there redundantly."""

    strategy = TP_SC


class DpScOptimizer(CanzonaOptimizer):
    """DP-SC: all-reduce gradients over DP and update everything on every rank."""

    strategy = DP_SC
