"""Lower bounds on the largest load that no plan of a request can beat, from the costs alone.

Shared by the planner (which reports them and stops searching at them) and the validator (which
recomputes the DP bound from a file's own costs). Pure arithmetic: no planner, no runtime.

`dp_lower_bound(costs, D)`: every matrix (cost c) is updated by exactly one of D ranks, whatever
the cuts, α, bucket order or TP hosts (a relaxation of every constraint canzona adds). With
c1 ≥ c2 ≥ … ≥ cN and each rank possibly carrying a load of its own already (`base`, smallest
first b1 ≤ b2 ≤ …):

- the mean, (Σ c + Σ b) / D; the largest base; the largest matrix on the least loaded rank;
- pairing: for every k ≤ min(N, D + 1), either two of the k largest matrices share a rank
  (load ≥ c(k−1) + ck), or they sit on k different ranks, and then either one of those ranks
  also takes another matrix (≥ ck + cN), or the other D − k ranks carry every other matrix
  (≥ their mean). The smallest of these is a bound for that k (at k = D + 1 only the first
  case is possible: pigeonhole). Base loads add their smallest (their D − k smallest for the
  last case).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def dp_lower_bound(costs: Sequence[float], num_ranks: int, base: Sequence[float] = ()) -> float:
    """The largest load no assignment of `costs` to `num_ranks` ranks (each carrying `base`
    already; empty: nothing) can go below (see the module docstring)."""
    bases = sorted(base) if base else [0.0] * num_ranks
    items = sorted(costs, reverse=True)
    total, low = math.fsum(items), bases[0]
    if not items:
        return max(sum(bases) / num_ranks, bases[-1])
    bound = max((total + math.fsum(bases)) / num_ranks, items[0] + low, bases[-1])
    prefix = [0.0]
    for cost in items:
        prefix.append(prefix[-1] + cost)
    base_prefix = [0.0]
    for value in bases:
        base_prefix.append(base_prefix[-1] + value)
    smallest = items[-1]
    for k in range(2, min(len(items), num_ranks + 1) + 1):
        shared = items[k - 2] + items[k - 1] + low
        if k <= num_ranks:
            rest = total - prefix[k]
            extra = items[k - 1] + smallest + low if k < len(items) else math.inf
            others = num_ranks - k
            spread = (rest + base_prefix[others]) / others if others else (math.inf if rest > 0 else 0.0)
            shared = min(shared, extra, spread)
        bound = max(bound, shared)
    return bound


def device_lower_bound(
    total: float, devices: int, dp_bound: float, tp: int, largest_piece: float, adamw: Sequence[float]
) -> float:
    """The busiest device no plan can go below: the mean ((`total` matrix work + every device's
    AdamW) / devices); a DP rank's share of the DP bound (its matrices stay in its TP group, and
    teams only add work) over its `tp` devices; the `largest_piece` no plan can split further (a
    matrix update, or the smallest share a team can give it); each on the device with the least
    AdamW work (`adamw`, per device), and the largest AdamW load itself."""
    low = min(adamw, default=0.0)
    return max((total + math.fsum(adamw)) / devices, dp_bound / tp + low, largest_piece + low, max(adamw, default=0.0))
