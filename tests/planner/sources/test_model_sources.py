"""Model sources: presets, Hugging Face config.json files and parameter-list files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from canzona.planner.sources.catalog import PRESETS, enumerate_params
from canzona.planner.sources.hf_config import SUPPORTED_ARCHITECTURES, architecture_from_hf
from canzona.planner.sources.load import count_params, list_presets, load_model
from canzona.planner.spec import ADAMW, MATRIX, ModelOptions, ParamSpec, PlanError

# Shape-relevant keys of the published config.json files (other keys kept where they could
# plausibly confuse a reader, e.g. rope settings and flags).
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "max_window_layers": 36,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "max_window_layers": 28,
    "model_type": "qwen2",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 152064,
}
LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 8.0, "rope_type": "llama3"},
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "vocab_size": 128256,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rope_scaling": {"factor": 40, "type": "yarn"},
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def assert_one_line_error(excinfo: pytest.ExceptionInfo[PlanError], *fragments: str) -> None:
    """The error is a one-line PlanError containing every fragment."""
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def write(path: Path, data: Any) -> str:
    """Write `data` as JSON or YAML by suffix; return the path as a string."""
    text = json.dumps(data) if path.suffix == ".json" else yaml.safe_dump(data)
    path.write_text(text)
    return str(path)


# --- presets -----------------------------------------------------------------------------


def test_preset_lookup_is_case_insensitive() -> None:
    model = load_model("Qwen3-8B", tp=8)
    assert (model.name, model.source, model.source_sha256) == ("qwen3-8b", "qwen3-8b", None)
    assert model.params == enumerate_params("qwen3-8b", PRESETS["qwen3-8b"], 8, ModelOptions())


def test_preset_options_are_applied() -> None:
    model = load_model("qwen3-0.6b", tp=2, options=ModelOptions(split_qkv="none"))
    qkv = {p.name: p for p in model.params}["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.submatrices == ((4096, 1024),)


def test_list_presets_is_sorted_and_complete() -> None:
    presets = list_presets()
    names = [name for name, _ in presets]
    assert names == sorted(PRESETS)
    assert dict(presets) == PRESETS


def test_unknown_preset_suggests_close_names() -> None:
    with pytest.raises(PlanError) as err:
        load_model("qwen3-3b", tp=1)
    assert_one_line_error(err, "unknown model 'qwen3-3b'; did you mean:", "qwen3-4b")


def test_unknown_preset_without_close_names_lists_all() -> None:
    with pytest.raises(PlanError) as err:
        load_model("gpt-17", tp=1)
    assert_one_line_error(err, "unknown model 'gpt-17'", *PRESETS)


def test_load_model_rejects_bad_tp() -> None:
    with pytest.raises(PlanError) as err:
        load_model("qwen3-8b", tp=0)
    assert_one_line_error(err, "tp must be an integer >= 1")
    with pytest.raises(PlanError) as err:
        load_model("llama3.1-70b", tp=16)
    assert_one_line_error(err, "tp 16 does not divide num_kv_groups 8")


# --- Hugging Face configs ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "preset", "tp"),
    [
        (QWEN3_8B, "qwen3-8b", 8),
        (LLAMA31_8B, "llama3.1-8b", 8),
        (MIXTRAL_8X7B, "mixtral-8x7b", 8),
        (QWEN3_30B_A3B, "qwen3-30b-a3b", 4),
        (DEEPSEEK_V3, "deepseek-v3", 8),
    ],
)
def test_hf_config_matches_preset(config: dict[str, Any], preset: str, tp: int) -> None:
    arch = architecture_from_hf(config)
    assert count_params(arch) == count_params(PRESETS[preset])
    options = ModelOptions(split_qkv="head", split_fc1=True)
    assert enumerate_params("hf", arch, tp, options) == enumerate_params(preset, PRESETS[preset], tp, options)


def test_qwen2_has_qkv_bias_and_no_qk_norm() -> None:
    arch = architecture_from_hf(QWEN25_7B)
    assert (arch.qkv_bias, arch.qk_norm, arch.head_dim) == (True, False, 128)
    assert count_params(arch) == 7_615_616_512  # published Qwen2.5-7B count
    names = {p.name for p in enumerate_params("qwen2.5-7b", arch, 4, ModelOptions())}
    assert "decoder.layers.27.self_attention.linear_qkv.bias" in names
    assert not any("q_layernorm" in name for name in names)


def test_model_type_is_enough_without_architectures() -> None:
    config = {k: v for k, v in LLAMA31_8B.items() if k != "architectures"}
    assert architecture_from_hf(config) == PRESETS["llama3.1-8b"]


def test_head_dim_defaults_to_hidden_over_heads() -> None:
    config = {k: v for k, v in QWEN3_8B.items() if k != "head_dim"}
    config["hidden_size"] = 2048
    assert architecture_from_hf(config).head_dim == 64


def test_qwen3_moe_sparse_step_and_mlp_only_layers() -> None:
    config = {**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    arch = architecture_from_hf(config)
    assert [arch.is_moe_layer(n) for n in range(6)] == [False, True, False, False, False, True]
    names = {p.name for p in enumerate_params("moe", arch, 4, ModelOptions())}
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names
    assert "decoder.layers.3.mlp.linear_fc1.weight" in names
    assert "decoder.layers.1.mlp.router.weight" in names
    assert "decoder.layers.2.mlp.router.weight" not in names


def test_deepseek_moe_layer_freq_and_uncompressed_queries() -> None:
    config = {**DEEPSEEK_V3, "num_hidden_layers": 6, "moe_layer_freq": 2, "q_lora_rank": None}
    arch = architecture_from_hf(config)
    assert [arch.is_moe_layer(n) for n in range(6)] == [False] * 3 + [False, True, False]
    params = {p.name: p for p in enumerate_params("v2", arch, 8, ModelOptions())}
    q_proj = params["decoder.layers.0.self_attention.linear_q_proj.weight"]
    assert (q_proj.shape, q_proj.tp_dim) == ((24576, 7168), 0)
    assert not any("q_down_proj" in name for name in params)


@pytest.mark.parametrize(
    ("config", "fragments"),
    [
        (
            {**QWEN3_8B, "architectures": ["GPT2LMHeadModel"]},
            ["unsupported Hugging Face architecture GPT2LMHeadModel", "Qwen3ForCausalLM"],
        ),
        ({"model_type": "gpt2"}, ["model_type 'gpt2'", "DeepseekV3ForCausalLM"]),
        (
            {k: v for k, v in QWEN3_8B.items() if k != "vocab_size"},
            ["Qwen3ForCausalLM", "missing required key 'vocab_size'"],
        ),
        ({k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"}, ["missing required key 'kv_lora_rank'"]),
        ({k: v for k, v in QWEN3_30B_A3B.items() if k != "num_experts"}, ["missing required key 'num_experts'"]),
        ({**LLAMA31_8B, "hidden_size": "4096"}, ["hidden_size must be an integer", "'4096'"]),
        ({**LLAMA31_8B, "tie_word_embeddings": "no"}, ["tie_word_embeddings must be true or false"]),
        ({**LLAMA31_8B, "attention_bias": True}, ["attention_bias=True is not supported"]),
        ({**QWEN3_30B_A3B, "mlp_only_layers": "all"}, ["mlp_only_layers must be a list"]),
        ({**QWEN3_30B_A3B, "decoder_sparse_step": 0}, ["decoder_sparse_step must be >= 1"]),
        ({**LLAMA31_8B, "num_attention_heads": 0}, ["num_attention_heads must be >= 1"]),
        ({**LLAMA31_8B, "num_attention_heads": 30}, ["hidden_size 4096", "head_dim is missing"]),
        ({**LLAMA31_8B, "num_hidden_layers": -1}, ["num_layers must be >= 1"]),
    ],
)
def test_bad_hf_config_raises(config: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(PlanError) as err:
        architecture_from_hf(config)
    assert_one_line_error(err, *fragments)


def test_supported_architectures_listed() -> None:
    assert set(SUPPORTED_ARCHITECTURES) == {
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
        "Qwen2ForCausalLM",
        "LlamaForCausalLM",
        "MixtralForCausalLM",
        "DeepseekV3ForCausalLM",
    }


def test_load_model_from_config_file_and_directory(tmp_path: Path) -> None:
    model_dir = tmp_path / "Qwen3-8B"
    model_dir.mkdir()
    path = write(model_dir / "config.json", QWEN3_8B)
    sha = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    model = load_model(path, tp=4)
    assert (model.name, model.source, model.source_sha256) == ("Qwen3-8B", path, sha)
    assert model.params == enumerate_params("qwen3-8b", PRESETS["qwen3-8b"], 4, ModelOptions())
    from_dir = load_model(str(model_dir), tp=4)
    assert (from_dir.source, from_dir.source_sha256, from_dir.params) == (
        str(model_dir),
        sha,
        model.params,
    )


# --- parameter-list files ----------------------------------------------------------------

ENTRIES = [
    {"name": "embed_tokens.weight", "shape": [1000, 64], "tp_dim": 0},
    {
        "name": "layers.0.attn.qkv.weight",
        "shape": [192, 64],
        "tp_dim": 0,
        "submatrices": [[64, 64], [64, 64], [64, 64]],
    },
    {"name": "layers.0.attn.out.weight", "shape": [64, 64], "tp_dim": 1},
    {"name": "layers.0.ln.weight", "shape": [64], "tp_dim": None},
    {"name": "layers.0.mlp.gate.weight", "shape": [4, 64], "tp_dim": None, "optimizer": "adamw"},
    {"name": "layers.0.conv.weight", "shape": [8, 4, 3], "tp_dim": 0},
    {"name": "layers.0.expert.weight", "shape": [128, 64], "tp_dim": 0, "expert": [3, 8], "dtype": "fp32"},
    {"name": "lm_head.weight", "shape": [1000, 64], "tp_dim": 0},
]


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
@pytest.mark.parametrize("mapping", [True, False])
def test_param_file_loads(tmp_path: Path, suffix: str, mapping: bool) -> None:
    data = {"name": "toy", "params": ENTRIES} if mapping else ENTRIES
    path = write(tmp_path / f"my-model{suffix}", data)
    model = load_model(path, tp=2)
    assert model.name == ("toy" if mapping else "my-model")
    assert model.source == path
    assert model.source_sha256 == hashlib.sha256(Path(path).read_bytes()).hexdigest()
    assert [p.name for p in model.params] == [e["name"] for e in ENTRIES]
    params = {p.name: p for p in model.params}
    assert [params[e["name"]].optimizer for e in ENTRIES] == [
        ADAMW,
        MATRIX,
        MATRIX,
        ADAMW,
        ADAMW,
        ADAMW,
        MATRIX,
        ADAMW,
    ]
    assert params["layers.0.attn.qkv.weight"].submatrices == ((64, 64),) * 3
    assert params["layers.0.attn.out.weight"] == ParamSpec("layers.0.attn.out.weight", (64, 64), 1, MATRIX, ((64, 64),))
    assert params["layers.0.ln.weight"].submatrices == ()
    expert = params["layers.0.expert.weight"]
    assert (expert.expert, expert.dtype, expert.shape) == (True, "fp32", (128, 64))
    assert (expert.expert_index, expert.num_experts) == (3, 8)


def test_explicit_optimizer_overrides_name_default(tmp_path: Path) -> None:
    path = write(
        tmp_path / "m.yaml", [{"name": "lm_head.weight", "shape": [10, 4], "tp_dim": None, "optimizer": "matrix"}]
    )
    (param,) = load_model(path, tp=1).params
    assert (param.optimizer, param.submatrices) == (MATRIX, ((10, 4),))


BAD_ENTRIES = [
    ({"name": "w", "shape": [4, 4], "tp_dim": 0, "bias": True}, "field 'bias': unknown key"),
    ({"name": "w", "shape": [4, 4]}, "field 'tp_dim': missing required key"),
    ({"name": "w", "shape": "4x4", "tp_dim": 0}, "field 'shape'"),
    ({"name": "w", "shape": [4, "4"], "tp_dim": 0}, "field 'shape.1'"),
    ({"name": "w", "shape": [4, 4.0], "tp_dim": 0}, "field 'shape.1'"),
    ({"name": "w", "shape": [4, 4], "tp_dim": True}, "field 'tp_dim'"),
    ({"name": "w", "shape": [4, 4], "tp_dim": 0, "optimizer": "muon"}, "field 'optimizer'"),
    ({"name": "w", "shape": [4, 4], "tp_dim": 2}, "tp_dim 2 is out of range"),
    ({"name": "w", "shape": [4, 0], "tp_dim": 0}, "positive sizes"),
    ({"name": "w", "shape": [], "tp_dim": None}, "non-empty"),
    ({"name": "w", "shape": [4, 4, 4], "tp_dim": 0, "optimizer": "matrix"}, "2-D shape"),
    ({"name": "w", "shape": [4, 4], "tp_dim": 0, "submatrices": [[4, 3]]}, "consecutive row blocks"),
    ({"name": "w.norm", "shape": [4, 4], "tp_dim": 0, "submatrices": [[4, 4]]}, "only allowed for matrix"),
    ({"name": "w", "shape": [4, 4], "tp_dim": 0, "dtype": "int8"}, "dtype 'int8'"),
    ({"name": "", "shape": [4, 4], "tp_dim": 0}, "name must not be empty"),
    ("w: [4, 4]", "must be a mapping with keys name, shape, tp_dim"),
]


@pytest.mark.parametrize(("entry", "fragment"), BAD_ENTRIES)
def test_bad_param_entry_names_index_and_field(tmp_path: Path, entry: Any, fragment: str) -> None:
    good = {"name": "ok", "shape": [2], "tp_dim": None}
    path = write(tmp_path / "bad.json", [good, entry])
    with pytest.raises(PlanError) as err:
        load_model(path, tp=1)
    assert_one_line_error(err, "parameter entry 1", fragment)


@pytest.mark.parametrize(
    ("data", "fragments"),
    [
        ({"name": "m", "params": [], "version": 2}, ["field 'version': unknown key"]),
        ({"params": [{"name": "w", "shape": [2], "tp_dim": None}]}, ["field 'name'"]),
        ({"name": "m", "params": []}, ["lists no parameters"]),
        ([], ["lists no parameters"]),
        ("just text", ["must hold a list of parameters", "str"]),
        ([{"name": "w", "shape": [2], "tp_dim": None}] * 2, ["'w' appears twice"]),
        (
            [{"name": "w", "shape": [6, 4], "tp_dim": 0, "submatrices": [[3, 4], [3, 4]]}],
            ["tp 4 does not divide dim 0", "'w'"],
        ),
    ],
)
def test_bad_param_file_raises(tmp_path: Path, data: Any, fragments: list[str]) -> None:
    path = write(tmp_path / "bad.yaml", data)
    with pytest.raises(PlanError) as err:
        load_model(path, tp=4)
    assert_one_line_error(err, *fragments)


@pytest.mark.parametrize(
    ("filename", "text", "fragments"),
    [
        ("broken.yaml", "params: [\n  {name: w,\n", ["cannot parse", "broken.yaml", "line"]),
        ("broken.yml", "a: b: c\n", ["cannot parse", "line 1"]),
        ("broken.json", '{"name": "m", "params": [}', ["cannot parse", "broken.json", "line 1"]),
        ("model.txt", "[]", ["must end in .json, .yaml or .yml"]),
    ],
)
def test_malformed_files_raise(tmp_path: Path, filename: str, text: str, fragments: list[str]) -> None:
    path = tmp_path / filename
    path.write_text(text)
    with pytest.raises(PlanError) as err:
        load_model(str(path), tp=1)
    assert_one_line_error(err, *fragments)


def test_binary_file_raises(tmp_path: Path) -> None:
    path = tmp_path / "weights.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PlanError) as err:
        load_model(str(path), tp=1)
    assert_one_line_error(err, "not UTF-8")


def test_missing_file_raises(tmp_path: Path) -> None:
    path = str(tmp_path / "nowhere" / "model.yaml")
    with pytest.raises(PlanError) as err:
        load_model(path, tp=1)
    assert_one_line_error(err, "cannot read model file", "model.yaml")


def test_directory_without_config_raises(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as err:
        load_model(str(tmp_path), tp=1)
    assert_one_line_error(err, "cannot read model file", "config.json")


def test_hf_config_file_errors_are_one_line(tmp_path: Path) -> None:
    path = write(tmp_path / "config.json", {**QWEN3_8B, "architectures": ["BertModel"]})
    with pytest.raises(PlanError) as err:
        load_model(path, tp=1)
    assert_one_line_error(err, "BertModel", "supported:")


@pytest.mark.parametrize("tp", [1, 2, 8])
@pytest.mark.parametrize("split", [False, True])
def test_fused_param_file_rows_match_the_catalog_fc1(tmp_path: Path, tp: int, split: bool) -> None:
    """`fused: 2` in a parameter list lays out fc1 exactly as the catalog does for Qwen3."""
    from canzona.planner.sources.catalog import PRESETS, enumerate_params

    entry = {"name": "mlp.linear_fc1.weight", "shape": [2 * 25600, 5120], "tp_dim": 0, "fused": 2, "split_fused": split}
    (param,) = load_model(write(tmp_path / "m.yaml", [entry]), tp=tp).params
    catalog = {
        p.name: p for p in enumerate_params("qwen3-32b", PRESETS["qwen3-32b"], tp, ModelOptions(split_fc1=split))
    }
    fc1 = catalog["decoder.layers.0.mlp.linear_fc1.weight"]
    assert (param.row_blocks, param.submatrices) == (fc1.row_blocks, fc1.submatrices)


@pytest.mark.parametrize(
    ("entry", "tp", "message"),
    [
        ({"name": "w", "shape": [8, 4], "tp_dim": 0, "fused": 1}, 1, "must be >= 2"),
        ({"name": "w", "shape": [9, 4], "tp_dim": 0, "fused": 2}, 1, "does not divide the 9 rows"),
        ({"name": "w", "shape": [8, 4], "tp_dim": 1, "fused": 2}, 1, "split on dim 0"),
        ({"name": "w", "shape": [12, 4], "tp_dim": 0, "fused": 2}, 4, "tp 4 x fused 2 does not divide the 12 rows"),
        ({"name": "w", "shape": [8, 4], "tp_dim": 0, "split_fused": True}, 1, "must be >= 2"),
    ],
)
def test_bad_fused_entries(tmp_path: Path, entry: dict, tp: int, message: str) -> None:
    with pytest.raises(PlanError, match=message) as error:
        load_model(write(tmp_path / "m.yaml", [entry]), tp=tp)
    assert "\n" not in str(error.value) and "parameter entry 0 ('w')" in str(error.value)


# --- dtype: from the config, or --dtype ---------------------------------------------------


def _config_file(tmp_path: Path, **changes: Any) -> str:
    path = tmp_path / "qwen3" / "config.json"
    path.parent.mkdir(exist_ok=True)
    config = {key: value for key, value in QWEN3_8B.items() if key != "torch_dtype"}
    path.write_text(json.dumps(config | changes))
    return str(path)


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"torch_dtype": "float32"}, "fp32"),
        ({"dtype": "float16"}, "fp16"),
        ({"dtype": "float32", "torch_dtype": "bfloat16"}, "fp32"),  # transformers writes `dtype` now
        ({"torch_dtype": "bfloat16"}, "bf16"),
        ({}, "bf16"),
        ({"torch_dtype": "auto"}, "bf16"),
    ],
)
def test_a_config_plans_in_its_own_dtype(tmp_path: Path, changes: dict[str, Any], expected: str) -> None:
    model = load_model(_config_file(tmp_path, **changes), 1)
    assert {p.dtype for p in model.params} == {expected}


def test_dtype_option_overrides_every_source(tmp_path: Path) -> None:
    for source in (_config_file(tmp_path, torch_dtype="float32"), "qwen3-0.6b", "examples/tiny_qwen3.yaml"):
        model = load_model(source, 1, ModelOptions(dtype="fp16"))
        assert {p.dtype for p in model.params} == {"fp16"}, source
    # an override also stands in for a dtype canzona would refuse
    assert {
        p.dtype for p in load_model(_config_file(tmp_path, torch_dtype="float64"), 1, ModelOptions(dtype="fp32")).params
    } == {"fp32"}


def test_an_unplannable_config_dtype_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as err:
        load_model(_config_file(tmp_path, torch_dtype="float64"), 1)
    assert_one_line_error(err, "float64", "--dtype")


# --- uneven TP shards (torch.chunk) ---------------------------------------------------------


def test_tp_shards_what_it_does_not_divide_in_torch_chunk_sizes(tmp_path: Path) -> None:
    """Qwen3's vocabulary (151936) and an FFN of 6001 over TP 3: DTensor's chunks; heads divide."""
    source = _config_file(tmp_path, num_attention_heads=24, num_key_value_heads=6, intermediate_size=6001)
    model = load_model(source, 3, ModelOptions(names="auto"))
    by_name = {p.name: p for p in model.params}
    head, down = by_name["lm_head.weight"], by_name["model.layers.0.mlp.down_proj.weight"]
    assert head.shape == (151936, 4096) and head.local_numel(3) == 50646 * 4096  # chunks 50646, 50646, 50644
    assert down.shape == (4096, 6001) and down.tp_dim == 1 and down.local_numel(3) == 4096 * 2001


def test_heads_must_divide_and_megatron_keeps_padding(tmp_path: Path) -> None:
    with pytest.raises(PlanError) as err:
        load_model(_config_file(tmp_path), 3, ModelOptions(names="auto"))  # 32 heads
    assert_one_line_error(err, "tp 3 does not divide num_heads 32", "whole attention heads")
    padded = load_model(
        _config_file(tmp_path, num_attention_heads=24, num_key_value_heads=6), 3, ModelOptions(names="megatron")
    )
    assert padded.params[0].shape[0] % (3 * 128) == 0  # Megatron pads the vocabulary to 128 x TP
