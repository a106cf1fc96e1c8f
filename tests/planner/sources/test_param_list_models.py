"""Parameter-list entries for the models people have: grouped 3-D experts, partial gradients,
and the TP size a live model's list was read at."""

from __future__ import annotations

from typing import Any

import pytest

from canzona.planner.sources.param_file import params_from_data
from canzona.planner.spec import ModelSpec, PlanError, validate_model

GATE_UP = {"name": "experts.gate_up_proj", "shape": [3, 8, 4], "tp_dim": 1, "grouped_experts": True, "fused": 2}


def specs(entries: list[dict[str, Any]], tp: int = 1, **document: Any) -> tuple[Any, ...]:
    return params_from_data({"name": "m", **document, "params": entries}, "m", tp)[1]


def test_grouped_experts_become_one_matrix_per_expert() -> None:
    params = specs([{"name": "norm", "shape": [4], "tp_dim": None, "grad_reduce": "tp"}, GATE_UP,
                    {"name": "experts.down_proj", "shape": [3, 4, 4], "tp_dim": 2, "grouped_experts": True}], tp=2)
    assert [p.name for p in params] == ["norm", *(f"experts.gate_up_proj[{e}]" for e in range(3)),
                                        *(f"experts.down_proj[{e}]" for e in range(3))]
    gate_up = params[1:4]
    assert all(p.shape == (8, 4) and p.tp_dim == 0 and p.optimizer == "matrix" and p.parent == "experts.gate_up_proj"
               and p.num_experts == 3 for p in gate_up)
    assert [p.expert_index for p in gate_up] == [0, 1, 2]
    assert gate_up[0].row_blocks == (((0, 2), (4, 6), (2, 4), (6, 8)),)  # each TP shard holds [gate; up] halves
    assert params[4].tp_dim == 1 and params[0].grad_reduce == "tp"
    validate_model(ModelSpec("m", params, "m"), 2)


def test_grouped_expert_submatrices_and_split_fused_apply_to_each_expert() -> None:
    split = specs([{**GATE_UP, "split_fused": True}], tp=2)
    assert split[0].submatrices == ((4, 4), (4, 4))
    blocks = specs([{"name": "w", "shape": [2, 6, 4], "tp_dim": None, "grouped_experts": True, "submatrices": [[2, 4], [4, 4]]}])
    assert [p.submatrices for p in blocks] == [((2, 4), (4, 4))] * 2 and blocks[0].row_blocks == (((0, 2),), ((2, 6),))


def test_the_tp_a_list_was_read_at() -> None:
    assert len(params_from_data({"name": "m", "tp": 2, "params": [GATE_UP]}, "m", 2)[1]) == 3
    with pytest.raises(PlanError, match="read from a model at TP 2 \\(its 'tp' key\\); plan it with --tp 2, not 1"):
        params_from_data({"name": "m", "tp": 2, "params": [GATE_UP]}, "m", 1)


@pytest.mark.parametrize(
    "entry, needle",
    [
        ({"name": "w", "shape": [8, 4], "tp_dim": 0, "grouped_experts": True}, "grouped_experts needs a 3-D shape"),
        ({"name": "w", "shape": [2, 8, 4], "tp_dim": 0, "grouped_experts": True}, "that is expert parallelism"),
        ({"name": "w", "shape": [2, 8, 4], "tp_dim": None, "grouped_experts": True, "optimizer": "adamw"}, "grouped_experts needs"),
        ({"name": "w", "shape": [2, 8, 4], "tp_dim": None, "grouped_experts": True, "expert": [0, 2]}, "without expert"),
        ({**GATE_UP, "tp_dim": 2}, "fused needs a matrix-optimizer parameter split on dim 0 (dim 1 for grouped experts)"),
        ({"name": "w", "shape": [8, 4], "tp_dim": 0, "grad_reduce": "tp"}, "replicated over TP"),
        ({"name": "w", "shape": [8], "tp_dim": None, "grad_reduce": "dp"}, "grad_reduce"),
        ({"name": "w", "shape": [70000, 2, 2], "tp_dim": None, "grouped_experts": True}, "70000 experts is above"),
    ],
)
def test_bad_entries(entry: dict[str, Any], needle: str) -> None:
    with pytest.raises(PlanError) as excinfo:
        specs([entry])
    message = str(excinfo.value)
    assert "\n" not in message and needle in message and "parameter entry 0" in message, message


def test_three_d_parameters_without_the_flag_stay_adamw() -> None:
    (param,) = specs([{"name": "conv.weight", "shape": [4, 4, 3], "tp_dim": None}])
    assert param.optimizer == "adamw" and param.parent is None


def test_described_tp_is_a_positive_integer() -> None:
    with pytest.raises(PlanError, match="parameter file: field 'tp'"):
        params_from_data({"name": "m", "tp": 0, "params": [GATE_UP]}, "m", 1)
