"""α is monotone over the whole ladder: on a sweep of more than 200 layouts (Qwen3 0.6B to 14B, TP
1 to 8, DP 2 to 16, 10M and 40M-element buckets, Muon), the DP partition at every α of
{0, 0.25, 0.5, 0.75, 1} has a largest load no larger than at any smaller α, in free order (the
default; every layout) and in registration order (every fourth). Includes the two layouts issue
26 found broken (qwen3-14b tp4 dp12; qwen3-0.6b tp4 dp16 with SOAP). The sweep is the DP
partition only, as `benchmarks/plan_sweep.py`; larger layouts are in the benchmark."""

from __future__ import annotations

import itertools
from functools import cache

import pytest

from canzona.planner.buffers import dp_instance
from canzona.planner.partition.costs import OptimizerConfig, make_cost_model, param_cost
from canzona.planner.partition.dp import DpInstance, partition, rank_loads
from canzona.planner.partition.free_order import partition_free
from canzona.planner.partition.layout import build_buffer
from canzona.planner.sources.load import load_model
from canzona.planner.spec import MATRIX, ModelSpec

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
GRID = list(
    itertools.product(
        ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b"),
        (1, 2, 4, 8),
        (2, 3, 4, 6, 8, 12, 16),
        (10_000_000, 40_000_000),
        ("muon",),
    )
)
ISSUE = [("qwen3-14b", 4, 12, 40_000_000, "muon"), ("qwen3-0.6b", 4, 16, 40_000_000, "soap")]
SWEEP = GRID[::4] + GRID[1::4] + GRID[2::4] + ISSUE  # three quarters of the grid


@cache
def _costs(name: str, tp: int, optimizer: str) -> tuple[ModelSpec, tuple[float, ...]]:
    model = load_model(name, tp)
    cost_model = make_cost_model("flops", OptimizerConfig(optimizer))
    return model, tuple(param_cost(param, cost_model) for param in model.params)


def instance(name: str, tp: int, dp: int, bucket_size: int, optimizer: str) -> DpInstance:
    """The DP partition problem of one layout's matrix buffer."""
    model, costs = _costs(name, tp, optimizer)
    return dp_instance(build_buffer(model, MATRIX, tp, dp, bucket_size), model, costs, dp)


def violations(layouts: list[tuple[str, int, int, int, str]], order: str) -> list[object]:
    """The layouts where some α's largest load is above a smaller α's, with their loads."""
    solve = partition_free if order == "free" else partition
    broken = []
    for layout in layouts:
        problem = instance(*layout)
        loads = [max(rank_loads(problem, solve(problem, alpha).owners)) for alpha in ALPHAS]
        if any(loads[j] > loads[i] * (1 + 1e-12) for i in range(len(ALPHAS)) for j in range(i + 1, len(ALPHAS))):
            broken.append((layout, loads))
    return broken


def test_the_sweep_is_large() -> None:
    assert len(set(SWEEP)) >= 200


@pytest.mark.parametrize("order", ["free", "registration"])
def test_a_larger_alpha_is_never_worse(order: str) -> None:
    layouts = SWEEP if order == "free" else SWEEP[::4] + ISSUE
    broken = violations(layouts, order)
    assert not broken, broken[:3]
