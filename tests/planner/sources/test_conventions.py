"""Naming conventions: presets and Hugging Face configs expanded to transformers' and
torchtitan's parameter names, order, TP dims, grouped 3-D experts and partial gradients."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from canzona.planner.sources.architecture import Architecture
from canzona.planner.sources.catalog import PRESETS, enumerate_params, num_param_entries
from canzona.planner.sources.hf_config import architecture_from_hf
from canzona.planner.sources.load import NAMES_AUTO, load_model
from canzona.planner.spec import MATRIX, ModelOptions, ParamSpec, PlanError, validate_model
from canzona.schedules.format import model_parameters

HF, TITAN = ModelOptions(names="hf"), ModelOptions(names="torchtitan")
# Tiny models of each supported transformers family (hidden 64, 2 layers; MoE layer 1).
TINY_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        tie_word_embeddings=False,
    ),
    "qwen3_moe": dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
    ),
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
    "mixtral": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        num_local_experts=4,
    ),
    "deepseek_v3": dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=256,
        n_routed_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
    ),
}


def tiny_moe(**changes: Any) -> Architecture:
    """One dense and one MoE layer (4 experts of 32), qk-norm, hidden 64."""
    fields = dict(
        h=64,
        ffn=128,
        num_layers=2,
        num_heads=4,
        num_kv_groups=2,
        head_dim=16,
        vocab=256,
        qk_norm=True,
        num_experts=4,
        top_k=2,
        expert_ffn=32,
        dense_layers=(0,),
        family="qwen3_moe",
    )
    return Architecture(**{**fields, **changes})


def names(params: tuple[ParamSpec, ...] | list[ParamSpec]) -> list[str]:
    return [p.name for p in params]


def folded(params: tuple[ParamSpec, ...]) -> list[tuple[str, list[int], str, int | None]]:
    return model_parameters((p.name, p.shape, p.dtype, p.tp_dim, p.parent) for p in params)


def matrix_work(params: tuple[ParamSpec, ...]) -> Counter[tuple[int, int]]:
    """The submatrices the optimizer updates, as a multiset of shapes."""
    return Counter(s for p in params if p.optimizer == MATRIX for s in p.submatrices)


# ---------------------------------------------------------------------------------------------
# Exact small cases


def _hf_layer(n: int, moe: bool) -> list[tuple[str, list[int], int | None]]:
    attention = [
        ("self_attn.q_proj.weight", [64, 64], 0),
        ("self_attn.k_proj.weight", [32, 64], 0),
        ("self_attn.v_proj.weight", [32, 64], 0),
        ("self_attn.o_proj.weight", [64, 64], 1),
        ("self_attn.q_norm.weight", [16], None),
        ("self_attn.k_norm.weight", [16], None),
    ]
    dense = [
        ("mlp.gate_proj.weight", [128, 64], 0),
        ("mlp.up_proj.weight", [128, 64], 0),
        ("mlp.down_proj.weight", [64, 128], 1),
    ]
    experts = [
        ("mlp.experts.gate_up_proj", [4, 64, 64], 1),
        ("mlp.experts.down_proj", [4, 64, 32], 2),
        ("mlp.gate.weight", [4, 64], None),
    ]
    norms = [("input_layernorm.weight", [64], None), ("post_attention_layernorm.weight", [64], None)]
    return [
        (f"model.layers.{n}.{name}", shape, tp_dim)
        for name, shape, tp_dim in attention + (experts if moe else dense) + norms
    ]


def test_hf_names_order_and_tp_dims_of_a_tiny_qwen3_moe() -> None:
    params = enumerate_params("tiny", tiny_moe(), 2, HF)
    expected = [
        ("model.embed_tokens.weight", [256, 64], 0),
        *_hf_layer(0, False),
        *_hf_layer(1, True),
        ("model.norm.weight", [64], None),
        ("lm_head.weight", [256, 64], 0),
    ]
    assert [(n, s, t) for n, s, _, t in folded(params)] == expected
    slices = [p for p in params if p.parent == "model.layers.1.mlp.experts.gate_up_proj"]
    assert names(slices) == [f"model.layers.1.mlp.experts.gate_up_proj[{e}]" for e in range(4)]
    assert all(
        p.shape == (64, 64) and p.tp_dim == 0 and p.expert_index == e and p.num_experts == 4
        for e, p in enumerate(slices)
    )
    # Packed colwise: each TP shard holds [gate shard; up shard]; updated in [gate; up] order.
    assert slices[0].row_blocks == (((0, 16), (32, 48), (16, 32), (48, 64)),)
    assert all(p.grad_reduce is None for p in params)  # transformers reduces q_norm/k_norm itself


def test_torchtitan_names_order_and_tp_dims() -> None:
    """torchtitan 0.3.0's registration order (checked against its real Qwen3 in
    tests/runtime/integrations/test_titan.py): fused wqkv first, the q/k norms after wo, routed
    experts under `moe.routed_experts.inner_experts`, `lm_head`."""
    params = enumerate_params("tiny", tiny_moe(), 2, TITAN)
    experts = "moe.routed_experts.inner_experts."
    layer1 = [n.removeprefix("layers.1.") for n, *_ in folded(params) if n.startswith("layers.1.")]
    assert layer1 == [
        "attention.qkv_linear.wqkv.weight",
        "attention.wo.weight",
        "attention.q_norm.weight",
        "attention.k_norm.weight",
        f"{experts}w1_EFD",
        f"{experts}w2_EDF",
        f"{experts}w3_EFD",
        "moe.router.gate.weight",
        "attention_norm.weight",
        "ffn_norm.weight",
    ]
    assert names(params)[0] == "tok_embeddings.weight" and names(params)[-2:] == ["norm.weight", "lm_head.weight"]
    layer0 = [n for n in names(params) if n.startswith("layers.0.feed_forward")]
    assert layer0 == [
        "layers.0.feed_forward.w1.weight",
        "layers.0.feed_forward.w2.weight",
        "layers.0.feed_forward.w3.weight",
    ]
    tp_dims = {n: t for n, _, _, t in folded(params)}
    assert tuple(tp_dims[f"layers.1.{experts}{w}"] for w in ("w1_EFD", "w2_EDF", "w3_EFD")) == (1, 2, 1)
    assert (tp_dims["tok_embeddings.weight"], tp_dims["lm_head.weight"], tp_dims["layers.0.attention.wo.weight"]) == (
        0,
        0,
        1,
    )
    assert all(p.grad_reduce is None for p in params)  # torchtitan's FSDP2 completes the norms' gradients over TP
    wqkv = next(p for p in params if p.name.endswith("wqkv.weight"))  # Q, K, V per KV head, as Megatron's linear_qkv
    megatron_qkv = next(p for p in enumerate_params("tiny", tiny_moe(), 2) if p.name.endswith("linear_qkv.weight"))
    assert (wqkv.shape, wqkv.row_blocks, wqkv.submatrices) == (
        megatron_qkv.shape,
        megatron_qkv.row_blocks,
        megatron_qkv.submatrices,
    )


def test_tied_embeddings_have_no_output_projection() -> None:
    arch = PRESETS["qwen3-0.6b"]
    assert names(enumerate_params("m", arch, 1, HF))[-1] == "model.norm.weight"
    assert names(enumerate_params("m", arch, 1, TITAN))[-1] == "norm.weight"


def test_mixtral_registers_its_router_first_and_deepseek_its_shared_experts_last() -> None:
    mixtral = [
        n
        for n, *_ in folded(enumerate_params("m", PRESETS["mixtral-8x7b"], 1, HF))
        if n.startswith("model.layers.0.mlp")
    ]
    assert mixtral == [
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.experts.down_proj",
    ]
    deepseek = [
        n
        for n, *_ in folded(enumerate_params("m", PRESETS["deepseek-v3"], 1, HF))
        if n.startswith("model.layers.3.mlp")
    ]
    assert deepseek == [
        "model.layers.3.mlp.experts.gate_up_proj",
        "model.layers.3.mlp.experts.down_proj",
        "model.layers.3.mlp.gate.weight",
        "model.layers.3.mlp.shared_experts.gate_proj.weight",
        "model.layers.3.mlp.shared_experts.up_proj.weight",
        "model.layers.3.mlp.shared_experts.down_proj.weight",
    ]


def test_head_split_gives_one_submatrix_per_head() -> None:
    params = {p.name: p for p in enumerate_params("m", tiny_moe(), 2, replace(HF, split_qkv="head"))}
    q = params["model.layers.0.self_attn.q_proj.weight"]
    assert q.submatrices == ((16, 64),) * 4 and q.row_blocks == tuple(((16 * h, 16 * h + 16),) for h in range(4))


def test_split_fc1_splits_the_packed_expert_rows() -> None:
    params = enumerate_params("m", tiny_moe(), 2, replace(HF, split_fc1=True))
    gate_up = next(p for p in params if p.parent and "gate_up" in p.parent)
    assert gate_up.submatrices == ((32, 64), (32, 64))
    assert gate_up.row_blocks == (((0, 16), (32, 48)), ((16, 32), (48, 64)))


# ---------------------------------------------------------------------------------------------
# Every preset, every convention


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("options", [HF, TITAN], ids=["hf", "torchtitan"])
def test_every_preset_expands_validly_with_the_same_matrix_work(preset: str, options: ModelOptions) -> None:
    arch = PRESETS[preset]
    if options.names == "torchtitan" and arch.is_mla:
        with pytest.raises(PlanError, match="torchtitan names: .*latent attention"):
            enumerate_params(preset, arch, 1, options)
        return
    split = replace(options, split_fc1=True)
    params = enumerate_params(preset, arch, 2, split)
    assert len(params) == num_param_entries(arch, split)
    if params == enumerate_params(preset, arch, 2, options):  # nothing packed to split: the option is refused
        with pytest.raises(PlanError, match="split_fc1 true has no effect on"):
            load_model(preset, 2, split)
    else:
        validate_model(load_model(preset, 2, split), 2)
    assert len(set(names(params))) == len(params)
    megatron = enumerate_params(preset, arch, 1, ModelOptions(split_fc1=True))
    assert matrix_work(enumerate_params(preset, arch, 1, split)) == matrix_work(megatron)
    assert sum(p.numel for p in enumerate_params(preset, arch, 1, options)) == sum(p.numel for p in megatron)


def test_experts_are_planned_one_matrix_per_expert() -> None:
    params = enumerate_params("qwen3-30b-a3b", PRESETS["qwen3-30b-a3b"], 1, HF)
    slices = [p for p in params if p.parent is not None]
    assert len(slices) == 48 * 2 * 128
    assert {p.shape for p in slices} == {(1536, 2048), (2048, 768)}
    assert len(folded(params)) == 3 + 48 * 11  # embedding, norm, lm_head; 11 tensors per layer


# ---------------------------------------------------------------------------------------------
# Sources and options


def test_config_defaults_to_hf_names_and_presets_to_megatron(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen3", **TINY_CONFIGS["qwen3"]}))
    auto = ModelOptions(names=NAMES_AUTO)
    from_config = load_model(str(config), 2, auto)
    assert from_config.names == "hf" and from_config.params[0].name == "model.embed_tokens.weight"
    assert load_model(str(config), 2).names == "megatron"  # the Python API keeps Megatron's names unless asked
    assert (
        load_model(str(config), 2, ModelOptions(names="megatron")).params[0].name == "embedding.word_embeddings.weight"
    )
    preset = load_model("qwen3-0.6b", 1, auto)
    assert preset.names == "megatron" and preset.params[0].name == "embedding.word_embeddings.weight"
    assert load_model("qwen3-0.6b", 1, ModelOptions(names="torchtitan")).names == "torchtitan"


def test_qwen3_moe_config_written_by_transformers_5(tmp_path: Path) -> None:
    """transformers 5 writes Qwen3-MoE's expert count as num_local_experts."""
    data = {"model_type": "qwen3_moe", **TINY_CONFIGS["qwen3_moe"]}
    data["num_local_experts"] = data.pop("num_experts")
    assert architecture_from_hf(data).num_experts == 4


def test_sequence_parallel_marks_every_norm_and_nothing_else() -> None:
    for names_ in ("megatron", "hf"):
        model = load_model("qwen3-0.6b", 2, ModelOptions(names=names_, sequence_parallel=True))
        partial = {p.name for p in model.params if p.grad_reduce == "tp"}
        assert partial and partial == {p.name for p in model.params if "norm" in p.name and len(p.shape) == 1}
        assert all(p.tp_dim is None for p in model.params if p.grad_reduce)


@pytest.mark.parametrize(
    "source, options, tp, needles",
    [
        ("qwen3-8b", ModelOptions(names="hf", split_qkv="none"), 1, ["split_qkv none", "separate parameters"]),
        ("deepseek-v3", ModelOptions(names="torchtitan"), 1, ["torchtitan names", "latent attention"]),
        (
            "qwen3-8b",
            ModelOptions(names="hf"),
            3,
            ["hf names: tp 3 does not divide num_heads 32", "whole attention heads"],
        ),
        ("qwen3-8b", ModelOptions(names="flax"), 1, ["unknown naming convention 'flax'"]),
        ("examples/tiny_qwen3.yaml", ModelOptions(names="hf"), 1, ["--names hf applies to presets", "parameter list"]),
    ],
)
def test_convention_errors(source: str, options: ModelOptions, tp: int, needles: list[str]) -> None:
    with pytest.raises(PlanError) as excinfo:
        load_model(source, tp, options)
    message = str(excinfo.value)
    assert "\n" not in message and all(needle in message for needle in needles), message


def test_hf_and_torchtitan_shard_the_vocab_unevenly_megatron_pads_it() -> None:
    for options in (TITAN, ModelOptions(names="hf")):
        embedding = enumerate_params("m", tiny_moe(vocab=251), 2, options)[0]
        assert embedding.shape == (251, 64) and embedding.tp_dim == 0  # DTensor chunks of 126 and 125 rows
        assert embedding.local_numel(2) == 126 * 64  # each TP rank's slot: the larger chunk
    assert enumerate_params("m", tiny_moe(vocab=251), 2, ModelOptions())[0].shape == (256, 64)  # Megatron pads


# ---------------------------------------------------------------------------------------------
# Against the real transformers classes (random init on the meta device, no downloads)


def _plan_tp_dim(name: str, ndim: int, tp_plan: dict[str, str]) -> int | None:
    """The dim transformers' own TP plan shards a parameter on (None: replicated)."""

    def matches(pattern: str, target: str) -> bool:
        return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), target) is not None

    module, _, leaf = name.rpartition(".")
    style = next((s for pattern, s in tp_plan.items() if matches(pattern, name)), None)
    if style is None:
        style = next((s for pattern, s in tp_plan.items() if matches(pattern, module)), None)
        if style is not None and style.startswith("rowwise") and leaf == "bias":
            return None  # a rowwise layer's bias is added after the reduction: replicated
    if style in ("colwise", "colwise_gather_output", "embedding_rowwise"):
        return 0
    if style == "rowwise":
        return ndim - 1
    if style == "packed_colwise":
        return max(ndim - 2, 0)
    return None  # replicated_with_grad_allreduce, module-level styles, or not in the plan


@pytest.mark.parametrize("model_type", sorted(TINY_CONFIGS) + ["qwen3-tied"])
def test_hf_names_match_transformers(model_type: str) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    family = model_type.removesuffix("-tied")
    settings = dict(TINY_CONFIGS[family], **({"tie_word_embeddings": True} if model_type.endswith("-tied") else {}))
    config = transformers.AutoConfig.for_model(family, **settings)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    arch = architecture_from_hf(config.to_dict())
    ours = folded(enumerate_params(model_type, arch, 1, HF))
    theirs = [(name, list(p.shape)) for name, p in model.named_parameters()]
    assert [(name, shape) for name, shape, _, _ in ours] == theirs
    plan = model.tp_plan
    assert [tp_dim for *_, tp_dim in ours] == [_plan_tp_dim(name, p.ndim, plan) for name, p in model.named_parameters()]
