"""Read a Hugging Face `config.json` into an `Architecture`.

Only the keys that fix parameter shapes are read; `catalog.enumerate_params` does the rest, so
a model described by its config and the matching preset expand to the same parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from canzona.planner.sources.architecture import Architecture
from canzona.planner.spec import PlanError

_MODEL_TYPES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}


class _Config:
    """Typed access to a config dict; every failure is a one-line PlanError naming the key."""

    def __init__(self, config: dict[str, Any], architecture: str) -> None:
        self.config = config
        self.architecture = architecture

    def integer(self, key: str, default: int | None = None) -> int:
        """The integer at `key` (or `default` when absent; required when no default)."""
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlanError(f"{self.architecture} config: {key} must be an integer, got {value!r}")
        return value

    def optional_integer(self, key: str) -> int:
        """The integer at `key`, 0 when absent or null (e.g. DeepSeek's q_lora_rank)."""
        return 0 if self.config.get(key) is None else self.integer(key)

    def boolean(self, key: str, default: bool) -> bool:
        """The boolean at `key`, or `default` when absent."""
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise PlanError(f"{self.architecture} config: {key} must be true or false, got {value!r}")
        return value

    def integer_list(self, key: str) -> tuple[int, ...]:
        """The list of integers at `key`, empty when absent or null."""
        value = self.config.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise PlanError(f"{self.architecture} config: {key} must be a list of integers")
        return tuple(value)

    def reject(self, key: str) -> None:
        """Refuse a feature whose parameters the catalog does not model."""
        if self.config.get(key):
            raise PlanError(f"{self.architecture} config: {key}={self.config[key]!r} is not supported")

    def _get(self, key: str, default: Any) -> Any:
        if key in self.config and self.config[key] is not None:
            return self.config[key]
        if default is None:
            raise PlanError(f"{self.architecture} config: missing required key {key!r}")
        return default


def _dense_fields(cfg: _Config) -> dict[str, Any]:
    """The fields every supported architecture reads the same way."""
    h = cfg.integer("hidden_size")
    heads = cfg.integer("num_attention_heads")
    if heads < 1:
        raise PlanError(f"{cfg.architecture} config: num_attention_heads must be >= 1, got {heads}")
    if h % heads and cfg.config.get("head_dim") is None:
        raise PlanError(
            f"{cfg.architecture} config: hidden_size {h} is not a multiple of "
            f"num_attention_heads {heads} and head_dim is missing"
        )
    return dict(
        h=h,
        ffn=cfg.integer("intermediate_size"),
        num_layers=cfg.integer("num_hidden_layers"),
        num_heads=heads,
        num_kv_groups=cfg.integer("num_key_value_heads", heads),
        head_dim=cfg.integer("head_dim", h // heads),
        vocab=cfg.integer("vocab_size"),
        tied_embeddings=cfg.boolean("tie_word_embeddings", False),
    )


def _llama(cfg: _Config) -> Architecture:
    cfg.reject("attention_bias")
    cfg.reject("mlp_bias")
    return Architecture(**_dense_fields(cfg), family="llama")


def _qwen2(cfg: _Config) -> Architecture:
    return Architecture(**_dense_fields(cfg), qkv_bias=True, family="qwen2")


def _qwen3(cfg: _Config) -> Architecture:
    cfg.reject("attention_bias")
    return Architecture(**_dense_fields(cfg), qk_norm=True, family="qwen3")


def _qwen3_moe(cfg: _Config) -> Architecture:
    cfg.reject("attention_bias")
    fields = _dense_fields(cfg)
    step = cfg.integer("decoder_sparse_step", 1)
    if step < 1:
        raise PlanError(f"{cfg.architecture} config: decoder_sparse_step must be >= 1, got {step}")
    mlp_only = set(cfg.integer_list("mlp_only_layers"))
    # Hugging Face: layer n is sparse iff n not in mlp_only_layers and (n + 1) % step == 0.
    dense = tuple(n for n in range(fields["num_layers"]) if n in mlp_only or (n + 1) % step != 0)
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts; published configs say num_experts.
    experts = (
        "num_local_experts"
        if cfg.config.get("num_experts") is None and "num_local_experts" in cfg.config
        else "num_experts"
    )
    return Architecture(
        **fields,
        qk_norm=True,
        num_experts=cfg.integer(experts),
        top_k=cfg.integer("num_experts_per_tok"),
        expert_ffn=cfg.integer("moe_intermediate_size"),
        dense_layers=dense,
        family="qwen3_moe",
    )


def _mixtral(cfg: _Config) -> Architecture:
    fields = _dense_fields(cfg)
    return Architecture(
        **fields,
        num_experts=cfg.integer("num_local_experts"),
        top_k=cfg.integer("num_experts_per_tok"),
        expert_ffn=fields["ffn"],
        family="mixtral",
    )


def _deepseek_v3(cfg: _Config) -> Architecture:
    cfg.reject("attention_bias")
    fields = _dense_fields(cfg)
    nope, rope = cfg.integer("qk_nope_head_dim"), cfg.integer("qk_rope_head_dim")
    expert_ffn = cfg.integer("moe_intermediate_size")
    shared = cfg.integer("n_shared_experts", 0)
    first_dense = cfg.integer("first_k_dense_replace", 0)
    freq = cfg.integer("moe_layer_freq", 1)
    if freq < 1:
        raise PlanError(f"{cfg.architecture} config: moe_layer_freq must be >= 1, got {freq}")
    fields.update(num_kv_groups=fields["num_heads"], head_dim=nope + rope)
    return Architecture(
        **fields,
        num_experts=cfg.integer("n_routed_experts"),
        top_k=cfg.integer("num_experts_per_tok"),
        expert_ffn=expert_ffn,
        num_shared_experts=shared,
        shared_expert_ffn=shared * expert_ffn,
        first_dense_layers=first_dense,
        dense_layers=tuple(n for n in range(first_dense, fields["num_layers"]) if n % freq),
        q_lora=cfg.optional_integer("q_lora_rank"),
        kv_lora=cfg.integer("kv_lora_rank"),
        qk_nope=nope,
        qk_rope=rope,
        v_head=cfg.integer("v_head_dim"),
        family="deepseek_v3",
    )


_BUILDERS: dict[str, Callable[[_Config], Architecture]] = {
    "Qwen3ForCausalLM": _qwen3,
    "Qwen3MoeForCausalLM": _qwen3_moe,
    "Qwen2ForCausalLM": _qwen2,
    "LlamaForCausalLM": _llama,
    "MixtralForCausalLM": _mixtral,
    "DeepseekV3ForCausalLM": _deepseek_v3,
}

SUPPORTED_ARCHITECTURES = tuple(_BUILDERS)
"""Hugging Face `architectures` values that `architecture_from_hf` understands."""


def _architecture_name(config: dict[str, Any]) -> str:
    architectures = config.get("architectures")
    if isinstance(architectures, list) and architectures:
        name = architectures[0]
    elif architectures is None and "model_type" in config:
        name = _MODEL_TYPES.get(config["model_type"], f"model_type {config['model_type']!r}")
    else:
        name = repr(architectures)
    if name not in _BUILDERS:
        raise PlanError(
            f"unsupported Hugging Face architecture {name}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return name


def architecture_from_hf(config: dict[str, Any]) -> Architecture:
    """The `Architecture` described by a Hugging Face `config.json` (already parsed).

    Raises PlanError for an unsupported architecture, a missing required key or a value of
    the wrong type.
    """
    if not isinstance(config, dict):
        raise PlanError(f"a Hugging Face config must be a JSON object, got {type(config).__name__}")
    name = _architecture_name(config)
    return _BUILDERS[name](_Config(config, name))
