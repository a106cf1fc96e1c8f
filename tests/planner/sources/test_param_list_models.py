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
    params = specs(
        [
            {"name": "norm", "shape": [4], "tp_dim": None, "grad_reduce": "tp"},
            GATE_UP,
            {"name": "experts.down_proj", "shape": [3, 4, 4], "tp_dim": 2, "grouped_experts": True},
        ],
        tp=2,
    )
    assert [p.name for p in params] == [
        "norm",
        *(f"experts.gate_up_proj[{e}]" for e in range(3)),
        *(f"experts.down_proj[{e}]" for e in range(3)),
    ]
    gate_up = params[1:4]
    assert all(
        p.shape == (8, 4)
        and p.tp_dim == 0
        and p.optimizer == "matrix"
        and p.parent == "experts.gate_up_proj"
        and p.num_experts == 3
        for p in gate_up
    )
    assert [p.expert_index for p in gate_up] == [0, 1, 2]
    assert gate_up[0].row_blocks == (((0, 2), (4, 6), (2, 4), (6, 8)),)  # each TP shard holds [gate; up] halves
    assert params[4].tp_dim == 1 and params[0].grad_reduce == "tp"
    validate_model(ModelSpec("m", params, "m"), 2)


def test_grouped_expert_submatrices_and_split_fused_apply_to_each_expert() -> None:
    split = specs([{**GATE_UP, "split_fused": True}], tp=2)
    assert split[0].submatrices == ((4, 4), (4, 4))
    blocks = specs(
        [{"name": "w", "shape": [2, 6, 4], "tp_dim": None, "grouped_experts": True, "submatrices": [[2, 4], [4, 4]]}]
    )
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
        (
            {"name": "w", "shape": [2, 8, 4], "tp_dim": None, "grouped_experts": True, "optimizer": "adamw"},
            "grouped_experts needs",
        ),
        (
            {"name": "w", "shape": [2, 8, 4], "tp_dim": None, "grouped_experts": True, "expert": [0, 2]},
            "without expert",
        ),
        (
            {**GATE_UP, "tp_dim": 2},
            "fused needs a matrix-optimizer parameter split on dim 0 (dim 1 for grouped experts)",
        ),
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


# ---------------------------------------------------------------------------------------------
# Fused QKV weights (`qkv:`) and the split options


QKV = {
    "name": "attn.linear_qkv.weight",
    "shape": [128, 64],
    "tp_dim": 0,
    "qkv": {"query_groups": 2, "heads": 4, "head_dim": 16},
}


def test_a_fused_qkv_entry_is_split_as_megatron_groups_it() -> None:
    """The same row blocks the catalog gives Megatron's linear_qkv of that layout (a Qwen3
    config with 4 heads, 2 KV groups, head_dim 16), for every split_qkv."""
    from canzona.planner.sources.architecture import Architecture
    from canzona.planner.sources.catalog import enumerate_params
    from canzona.planner.spec import ModelOptions

    arch = Architecture(64, 128, 1, 4, 2, 16, 256, qk_norm=True, family="qwen3")
    for split in ("qkv", "head", "none"):
        expected = next(
            p
            for p in enumerate_params("t", arch, 2, ModelOptions(split_qkv=split))
            if p.name.endswith("linear_qkv.weight")
        )
        (param,) = params_from_data({"name": "m", "params": [QKV]}, "m", 2, split_qkv=split)[1]
        assert (param.row_blocks, param.submatrices) == (expected.row_blocks, expected.submatrices), split
    (qkv,) = params_from_data({"name": "m", "params": [QKV]}, "m", 2)[1]
    assert qkv.submatrices == ((64, 64), (32, 64), (32, 64))  # Q, K, V by default


def test_split_fc1_splits_every_fused_entry() -> None:
    (fc1,) = params_from_data(
        {"name": "m", "params": [{"name": "fc1", "shape": [8, 4], "tp_dim": 0, "fused": 2}]}, "m", 2, split_fc1=True
    )[1]
    assert fc1.submatrices == ((4, 4), (4, 4)) and fc1.row_blocks == (((0, 2), (4, 6)), ((2, 4), (6, 8)))


@pytest.mark.parametrize(
    "change, needle",
    [
        ({"qkv": {"query_groups": 3, "heads": 4, "head_dim": 16}}, "3 query groups do not divide 4 heads"),
        ({"qkv": {"query_groups": 2, "heads": 4, "head_dim": 8}}, "= 64 rows, but the shape has 128"),
        ({"tp_dim": 1}, "qkv needs a 2-D matrix-optimizer parameter split on dim 0"),
        ({"optimizer": "adamw"}, "qkv needs a 2-D matrix-optimizer parameter"),
        ({"fused": 2}, "without fused or submatrices"),
        ({"qkv": {"query_groups": 2, "heads": 4}}, "field 'qkv.head_dim': missing required key"),
    ],
)
def test_bad_fused_qkv_entries(change: dict[str, Any], needle: str) -> None:
    with pytest.raises(PlanError, match=needle.replace("(", "\\(").replace(")", "\\)")):
        specs([{**QKV, **change}])


def test_tp_must_leave_each_rank_whole_query_groups() -> None:
    with pytest.raises(PlanError, match="tp 4 does not divide its 2 query groups"):
        specs([QKV], tp=4)


@pytest.mark.parametrize(
    "options, needle",
    [
        ({"split_qkv": "head"}, "split_qkv head has no effect on m: it needs a fused QKV weight"),
        ({"split_qkv": "none"}, "split_qkv none has no effect on m"),
        ({"split_fc1": True}, "split_fc1 true has no effect on m: it needs a fused matrix"),
        ({"router_optimizer": "adamw"}, "router_optimizer adamw has no effect on m"),
    ],
)
def test_an_option_the_list_gives_nothing_to_is_refused(options: dict[str, Any], needle: str) -> None:
    """A schedule never records an option its plan did not apply."""
    from canzona.planner.sources.load import model_from_data
    from canzona.planner.spec import ModelOptions

    data = {"name": "m", "params": [{"name": "w", "shape": [8, 4], "tp_dim": 0}]}
    with pytest.raises(PlanError, match=needle):
        model_from_data(data, "m", "m.yaml", "0" * 64, 1, ModelOptions(**options))
    if "split_qkv" in options:  # a list with a fused QKV weight takes it
        taken = model_from_data({"name": "m", "params": [QKV]}, "m", "m.yaml", "0" * 64, 2, ModelOptions(**options))
        assert len(taken.params[0].submatrices) == {"head": 8, "none": 1}[options["split_qkv"]]
