"""Presets and their expansion into Megatron-core parameters."""

from __future__ import annotations

from dataclasses import replace

import pytest

from canzona.planner.sources.architecture import Architecture
from canzona.planner.sources.catalog import (
    PRESETS,
    count_params,
    enumerate_params,
    padded_vocab,
)
from canzona.planner.spec import ADAMW, MATRIX, ModelOptions, ModelSpec, ParamSpec, PlanError, validate_model

# Expected parameter totals, in billions.
EXPECTED_TOTALS_B = {
    "qwen3-0.6b": 0.596,
    "qwen3-1.7b": 1.721,
    "qwen3-4b": 4.022,
    "qwen3-8b": 8.191,
    "qwen3-14b": 14.768,
    "qwen3-32b": 32.762,
    "qwen3-30b-a3b": 30.532,
    "qwen3-235b-a22b": 235.094,
    "llama3.1-8b": 8.030,
    "llama3.1-70b": 70.554,
    "llama3.1-405b": 405.853,
    "mixtral-8x7b": 46.703,
    "deepseek-v3": 671.03,
}


def by_name(params: tuple[ParamSpec, ...]) -> dict[str, ParamSpec]:
    """Index a parameter list by name."""
    return {p.name: p for p in params}


def expand(preset: str, tp: int = 1, **options: object) -> dict[str, ParamSpec]:
    """The named parameters of a preset."""
    return by_name(enumerate_params(preset, PRESETS[preset], tp, ModelOptions(**options)))


def test_every_design_preset_is_present() -> None:
    assert set(PRESETS) == set(EXPECTED_TOTALS_B)


@pytest.mark.parametrize("preset", sorted(EXPECTED_TOTALS_B))
def test_preset_total_matches_design(preset: str) -> None:
    total = count_params(PRESETS[preset])
    assert total == pytest.approx(EXPECTED_TOTALS_B[preset] * 1e9, rel=1e-3)
    # Every preset vocab is a multiple of 128, so tp=1 adds no padding.
    params = enumerate_params(preset, PRESETS[preset], 1, ModelOptions())
    assert sum(p.numel for p in params) == total


def test_exact_totals_of_known_models() -> None:
    assert count_params(PRESETS["qwen3-8b"]) == 8_190_735_360
    assert count_params(PRESETS["llama3.1-8b"]) == 8_030_261_248
    assert count_params(PRESETS["mixtral-8x7b"]) == 46_702_792_704


def test_qwen3_32b_shapes() -> None:
    params = expand("qwen3-32b", tp=8)
    layer = "decoder.layers.63."
    assert params[layer + "self_attention.linear_qkv.weight"].shape == (10240, 5120)
    assert params[layer + "self_attention.linear_qkv.weight"].tp_dim == 0
    # nh·d = 8192 differs from h = 5120.
    assert params[layer + "self_attention.linear_proj.weight"].shape == (5120, 8192)
    assert params[layer + "self_attention.linear_proj.weight"].tp_dim == 1
    assert params[layer + "mlp.linear_fc1.weight"].shape == (51200, 5120)
    assert params[layer + "mlp.linear_fc2.weight"].shape == (5120, 25600)
    assert params[layer + "self_attention.q_layernorm.weight"].shape == (128,)
    assert params["output_layer.weight"].shape == (152576, 5120)
    assert "decoder.layers.64.mlp.linear_fc1.weight" not in params


def test_qwen3_0_6b_head_width_differs_from_hidden() -> None:
    params = expand("qwen3-0.6b")
    qkv = params["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == (4096, 1024)
    assert qkv.submatrices == ((2048, 1024), (1024, 1024), (1024, 1024))
    assert params["decoder.layers.0.self_attention.linear_proj.weight"].shape == (1024, 2048)
    assert "output_layer.weight" not in params  # tied embeddings


def test_deepseek_v3_mla_and_moe_shapes() -> None:
    params = expand("deepseek-v3", tp=8)
    attn = "decoder.layers.0.self_attention."
    expected = {
        "decoder.layers.0.input_layernorm.weight": ((7168,), None, ADAMW),
        attn + "linear_proj.weight": ((7168, 16384), 1, MATRIX),
        attn + "linear_q_down_proj.weight": ((1536, 7168), None, MATRIX),
        attn + "linear_q_up_proj.layer_norm_weight": ((1536,), None, ADAMW),
        attn + "linear_q_up_proj.weight": ((24576, 1536), 0, MATRIX),
        attn + "linear_kv_down_proj.weight": ((576, 7168), None, MATRIX),
        attn + "linear_kv_up_proj.layer_norm_weight": ((512,), None, ADAMW),
        attn + "linear_kv_up_proj.weight": ((32768, 512), 0, MATRIX),
        "decoder.layers.2.mlp.linear_fc1.weight": ((36864, 7168), 0, MATRIX),
        "decoder.layers.3.mlp.router.weight": ((256, 7168), None, MATRIX),
        "decoder.layers.3.mlp.experts.linear_fc1.weight255": ((4096, 7168), 0, MATRIX),
        "decoder.layers.3.mlp.shared_experts.linear_fc1.weight": ((4096, 7168), 0, MATRIX),
        "decoder.layers.60.mlp.shared_experts.linear_fc2.weight": ((7168, 2048), 1, MATRIX),
    }
    for name, (shape, tp_dim, optimizer) in expected.items():
        assert (params[name].shape, params[name].tp_dim, params[name].optimizer) == (
            shape,
            tp_dim,
            optimizer,
        ), name
    assert "decoder.layers.2.mlp.router.weight" not in params
    assert "decoder.layers.3.mlp.linear_fc1.weight" not in params
    assert "decoder.layers.0.self_attention.linear_qkv.weight" not in params
    assert not params["decoder.layers.3.mlp.shared_experts.linear_fc1.weight"].expert


def test_qwen3_30b_a3b_experts() -> None:
    params = enumerate_params("qwen3-30b-a3b", PRESETS["qwen3-30b-a3b"], 4, ModelOptions())
    named = by_name(params)
    fc1 = named["decoder.layers.0.mlp.experts.linear_fc1.weight0"]
    fc2 = named["decoder.layers.47.mlp.experts.linear_fc2.weight127"]
    assert (fc1.shape, fc1.tp_dim, fc1.expert, fc1.optimizer) == ((1536, 2048), 0, True, MATRIX)
    assert (fc2.shape, fc2.tp_dim, fc2.expert) == ((2048, 768), 1, True)
    router = named["decoder.layers.0.mlp.router.weight"]
    assert (router.shape, router.tp_dim, router.submatrices) == ((128, 2048), None, ((128, 2048),))
    assert not any("shared_experts" in p.name or ".mlp.linear_fc1" in p.name for p in params)
    layer0 = [
        p.name.removeprefix("decoder.layers.0.mlp.")
        for p in params
        if p.name.startswith("decoder.layers.0.mlp.experts.")
    ]
    expected = [f"experts.linear_fc1.weight{i}" for i in range(128)]
    expected += [f"experts.linear_fc2.weight{i}" for i in range(128)]
    assert layer0 == expected


def test_router_optimizer_option() -> None:
    params = expand("mixtral-8x7b", router_optimizer=ADAMW)
    router = params["decoder.layers.5.mlp.router.weight"]
    assert (router.optimizer, router.submatrices) == (ADAMW, ())


def test_dense_layer_registration_order() -> None:
    params = enumerate_params("qwen3-8b", PRESETS["qwen3-8b"], 1, ModelOptions())
    names = [p.name for p in params]
    assert names[0] == "embedding.word_embeddings.weight"
    assert names[1:10] == [
        "decoder.layers.0." + suffix
        for suffix in (
            "self_attention.linear_proj.weight",
            "self_attention.linear_qkv.layer_norm_weight",
            "self_attention.linear_qkv.weight",
            "self_attention.q_layernorm.weight",
            "self_attention.k_layernorm.weight",
            "mlp.linear_fc1.layer_norm_weight",
            "mlp.linear_fc1.weight",
            "mlp.linear_fc2.weight",
        )
    ] + ["decoder.layers.1.self_attention.linear_proj.weight"]
    assert names[-2:] == ["decoder.final_layernorm.weight", "output_layer.weight"]
    assert len(names) == 1 + 36 * 8 + 2


def test_qkv_bias_follows_qkv_weight() -> None:
    arch = Architecture(64, 128, 1, 4, 2, 16, 1000, qkv_bias=True)
    params = enumerate_params("tiny", arch, 2, ModelOptions())
    names = [p.name for p in params]
    bias_index = names.index("decoder.layers.0.self_attention.linear_qkv.bias")
    assert names[bias_index - 1] == "decoder.layers.0.self_attention.linear_qkv.weight"
    bias = params[bias_index]
    assert (bias.shape, bias.tp_dim, bias.optimizer, bias.submatrices) == ((128,), 0, ADAMW, ())


def test_vocab_padding() -> None:
    assert padded_vocab(151936, 8) == 152576
    assert padded_vocab(151936, 8) % 1024 == 0
    assert padded_vocab(151936, 1) == 151936
    params = expand("qwen3-8b", tp=8)
    assert params["embedding.word_embeddings.weight"].shape == (152576, 4096)
    assert params["output_layer.weight"].shape == (152576, 4096)
    # count_params is before padding even when the vocab is not a multiple of 128.
    odd = replace(PRESETS["qwen3-0.6b"], vocab=1000)
    padded = enumerate_params("odd", odd, 1, ModelOptions())
    assert count_params(odd) == sum(p.numel for p in padded) - 24 * 1024


@pytest.mark.parametrize("preset", ["qwen3-8b", "qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"])
@pytest.mark.parametrize("split_qkv", ["none", "qkv", "head"])
@pytest.mark.parametrize("split_fc1", [False, True])
def test_submatrices_cover_each_matrix(preset: str, split_qkv: str, split_fc1: bool) -> None:
    options = ModelOptions(split_qkv=split_qkv, split_fc1=split_fc1)
    params = enumerate_params(preset, PRESETS[preset], 4, options)
    for param in params:
        if param.optimizer == MATRIX:
            assert len(param.shape) == 2, param.name
            assert sum(m * n for m, n in param.submatrices) == param.numel, param.name
        else:
            assert param.submatrices == (), param.name


@pytest.mark.parametrize(
    ("split_qkv", "expected"),
    [
        ("none", ((6144, 4096),)),
        ("qkv", ((4096, 4096), (1024, 4096), (1024, 4096))),
        ("head", ((128, 4096),) * 48),
    ],
)
def test_qkv_split_shapes(split_qkv: str, expected: tuple[tuple[int, int], ...]) -> None:
    params = expand("qwen3-8b", split_qkv=split_qkv)
    assert params["decoder.layers.0.self_attention.linear_qkv.weight"].submatrices == expected


def test_fc1_split_shapes() -> None:
    fused = expand("qwen3-8b")["decoder.layers.0.mlp.linear_fc1.weight"]
    split = expand("qwen3-8b", split_fc1=True)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert fused.submatrices == ((24576, 4096),)
    assert split.submatrices == ((12288, 4096), (12288, 4096))
    mixtral = expand("mixtral-8x7b", split_fc1=True)
    expert = mixtral["decoder.layers.0.mlp.experts.linear_fc1.weight7"]
    assert expert.submatrices == ((14336, 4096), (14336, 4096))


@pytest.mark.parametrize(
    ("preset", "tp", "fragments"),
    [
        ("qwen3-8b", 3, ["tp 3", "num_heads 32"]),
        ("qwen3-30b-a3b", 8, ["tp 8", "num_kv_groups 4"]),
        ("deepseek-v3", 3, ["tp 3", "num_heads 128"]),
        ("qwen3-8b", 0, ["tp must be an integer >= 1", "0"]),
        ("qwen3-8b", -2, ["tp must be an integer >= 1", "-2"]),
    ],
)
def test_bad_tp_raises(preset: str, tp: int, fragments: list[str]) -> None:
    with pytest.raises(PlanError) as err:
        enumerate_params(preset, PRESETS[preset], tp, ModelOptions())
    message = str(err.value)
    assert "\n" not in message
    assert preset in message
    for fragment in fragments:
        assert fragment in message


@pytest.mark.parametrize(
    ("arch", "fragment"),
    [
        (Architecture(64, 102, 2, 4, 4, 16, 1000), "ffn 102"),
        (Architecture(64, 128, 2, 4, 4, 16, 1000, num_experts=4, top_k=1, expert_ffn=6), "expert_ffn 6"),
        (
            Architecture(
                64,
                128,
                2,
                4,
                4,
                16,
                1000,
                num_experts=4,
                top_k=1,
                expert_ffn=8,
                num_shared_experts=1,
                shared_expert_ffn=10,
            ),
            "shared_expert_ffn 10",
        ),
    ],
)
def test_tp_not_dividing_ffn_raises(arch: Architecture, fragment: str) -> None:
    with pytest.raises(PlanError, match=f"tp 4 does not divide {fragment}") as err:
        enumerate_params("tiny", arch, 4, ModelOptions())
    assert "\n" not in str(err.value)


def test_unused_dense_ffn_is_not_checked() -> None:
    # Every layer is MoE, so a dense ffn that tp does not divide does not matter.
    arch = Architecture(64, 102, 2, 4, 4, 16, 1000, num_experts=4, top_k=1, expert_ffn=8)
    assert len(enumerate_params("tiny", arch, 4, ModelOptions())) > 0


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        (ModelOptions(split_qkv="rows"), "unknown split_qkv 'rows'"),
        (ModelOptions(router_optimizer="sgd"), "unknown router_optimizer 'sgd'"),
    ],
)
def test_bad_options_raise(options: ModelOptions, fragment: str) -> None:
    with pytest.raises(PlanError, match=fragment) as err:
        enumerate_params("qwen3-8b", PRESETS["qwen3-8b"], 1, options)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        (dict(h=0), "h must be >= 1"),
        (dict(num_heads=2.0), "num_heads must be an integer"),
        (dict(tied_embeddings=1), "tied_embeddings must be a boolean"),
        (dict(num_experts=4, top_k=5, expert_ffn=8), "top_k"),
        (dict(num_experts=4, top_k=1, expert_ffn=8, num_shared_experts=1), "shared_expert_ffn"),
        (dict(ffn=0), "ffn >= 1"),
        (dict(kv_lora=8), "MLA"),
        (dict(q_lora=-1), "q_lora must be >= 0"),
    ],
)
def test_invalid_architecture_raises(kwargs: dict[str, object], fragment: str) -> None:
    base = dict(h=64, ffn=128, num_layers=2, num_heads=4, num_kv_groups=4, head_dim=16, vocab=100)
    with pytest.raises(PlanError, match=fragment) as err:
        Architecture(**{**base, **kwargs})  # type: ignore[arg-type]
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("split_qkv", ["none", "qkv", "head"])
@pytest.mark.parametrize("split_fc1", [False, True])
@pytest.mark.parametrize("tp", [1, 2, 8])
def test_row_blocks_partition_the_gathered_rows(split_qkv: str, split_fc1: bool, tp: int) -> None:
    options = ModelOptions(split_qkv=split_qkv, split_fc1=split_fc1)
    params = {p.name: p for p in enumerate_params("qwen3-32b", PRESETS["qwen3-32b"], tp, options)}
    qkv = params["decoder.layers.0.self_attention.linear_qkv.weight"]
    fc1 = params["decoder.layers.0.mlp.linear_fc1.weight"]
    for param in (qkv, fc1):
        validate_model(ModelSpec("m", (param,), "m"), tp)  # covers every row once, matches shapes
    if split_qkv == "qkv":
        # Q of KV group 0 is the first 8 heads (64 heads / 8 groups) of 128 rows; K follows.
        assert qkv.row_blocks[0][0] == (0, 8 * 128)
        assert qkv.row_blocks[1][0] == (8 * 128, 9 * 128)
        assert qkv.row_blocks[2][0] == (9 * 128, 10 * 128)
    if split_qkv == "none":
        assert qkv.row_blocks == ()
    ffn_shard = 25600 // tp
    if split_fc1:
        # TP rank i's shard holds [gate_i; up_i]: gate blocks sit at even shard positions.
        assert fc1.row_blocks[0] == tuple((2 * i * ffn_shard, (2 * i + 1) * ffn_shard) for i in range(tp))
    elif tp > 1:
        assert fc1.row_blocks[0][:2] == ((0, ffn_shard), (2 * ffn_shard, 3 * ffn_shard))
    else:
        assert fc1.row_blocks == ()
