"""The logical state's building blocks, in one process: the documented state layout is what the
optimizer rules really keep, TP shards map onto the full tensor exactly once, and in-memory
filling copies overlaps, tolerates padding growth and refuses gaps."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from canzona.runtime.rules.optimizers import Hyperparameters, init_matrix_state, make_rule, matrix_update
from canzona.runtime.state.logical import Destination, LogicalTensor, fill_from, set_leaf, state_leaves
from canzona.schedules.reshard import full_runs, state_fields


@pytest.mark.parametrize(
    ("optimizer", "rows", "cols"),
    [
        ("muon", 24, 40),
        ("shampoo", 40, 24),
        ("shampoo", 16, 16),
        ("soap", 24, 40),
        ("soap", 48, 8),
        ("soap", 50, 50),
    ],
)
def test_documented_fields_are_the_rules_state(optimizer: str, rows: int, cols: int) -> None:
    hp = Hyperparameters(block_size=16, precondition_frequency=1, max_precond_dim=45, ns_steps=5)
    rule = make_rule(optimizer, hp)
    states = init_matrix_state(rule, (rows, cols), None, torch.device("cpu"))
    matrix_update(rule, states, torch.randn(rows, cols), None, 1)
    leaves = {path: tuple(t.shape) for path, t in state_leaves(states).items() if t is not None}
    assert leaves == {f"0/{name}": shape for name, shape in state_fields(optimizer, rows, cols, 16, 45)}
    assert all(t.is_contiguous() for t in state_leaves(states).values() if t is not None)


def test_leaves_round_trip() -> None:
    states: list[dict[str, Any]] = [{"momentum": torch.zeros(2, 2), "blocks": [{"L": torch.zeros(1)}, {"L": None}]}]
    assert list(state_leaves(states)) == ["0/momentum", "0/blocks/0/L", "0/blocks/1/L"]
    set_leaf(states, "0/blocks/1/L", torch.ones(3))
    assert torch.equal(states[0]["blocks"][1]["L"], torch.ones(3))


@pytest.mark.parametrize(("shape", "tp_dim"), [((6, 4), 0), ((6, 4), 1), ((2, 6, 3), 1), ((2, 3, 4), 2), ((5,), None)])
def test_full_runs_cover_the_full_tensor_once(shape: tuple[int, ...], tp_dim: int | None) -> None:
    tp = 2
    full = torch.arange(torch.Size(shape).numel()).reshape(shape)
    seen = torch.zeros(full.numel(), dtype=torch.long)
    for tp_rank in range(tp):
        local = full if tp_dim is None else full.chunk(tp, dim=tp_dim)[tp_rank].contiguous().reshape(-1)
        local = local.reshape(-1)
        for start, stop in ((0, 3), (3, local.numel())):  # two DP slices of the shard
            for at, index, length in full_runs(shape, tp_dim, tp, tp_rank, start, stop):
                assert torch.equal(full.reshape(-1)[at : at + length], local[index : index + length])
                seen[at : at + length] += 1
    assert bool((seen == (tp if tp_dim is None else 1)).all())


def _destination(offset: int, length: int, size: int) -> tuple[Destination, torch.Tensor]:
    target = torch.full((length,), -1.0)
    key = "adamw/x/exp_avg"
    return Destination({key: LogicalTensor((size,), [((offset,), target)])}, {}, {}), target


def test_fill_from_copies_overlaps_and_refuses_gaps() -> None:
    source = LogicalTensor((10,), [((0,), torch.arange(0.0, 4.0)), ((4,), torch.arange(4.0, 10.0))])
    dest, target = _destination(2, 5, 10)
    fill_from(dest, {"adamw/x/exp_avg": source})
    assert target.tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]
    grown, target = _destination(8, 4, 12)  # padded rows only the new layout has keep their zeros
    target.zero_()
    fill_from(grown, {"adamw/x/exp_avg": source})
    assert target.tolist() == [8.0, 9.0, 0.0, 0.0]
    holey = LogicalTensor((10,), [((0,), torch.arange(0.0, 4.0))])
    dest, _ = _destination(2, 5, 10)
    with pytest.raises(ValueError, match="does not cover the elements this rank needs"):
        fill_from(dest, {"adamw/x/exp_avg": holey})
    whole = Destination({"matrix/w/0/momentum": LogicalTensor((2, 2), [((0, 0), torch.zeros(2, 2))])}, {}, {})
    with pytest.raises(ValueError, match="is not whole"):
        fill_from(whole, {"matrix/w/0/momentum": LogicalTensor((2, 2), [((1, 0), torch.ones(1, 2))])})
