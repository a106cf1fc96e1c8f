"""The preset architectures and their expansion into parameter lists.

An `Architecture` (`architecture.py`) holds the handful of numbers that fix a transformer's
parameter shapes. `enumerate_params` expands one into the `ParamSpec`s Megatron-core registers (or, with
`ModelOptions.names`, transformers or torchtitan: `conventions.py`), in registration order,
with full shapes, the TP split dim, the optimizer class and the submatrices the matrix
optimizer updates independently. Presets and Hugging Face configs both end here.
"""

from __future__ import annotations

import re
from dataclasses import replace

from canzona.planner.sources.architecture import Architecture
from canzona.planner.sources.conventions import MEGATRON_LOCAL, MEGATRON_NAMES, expand_named, num_named_entries
from canzona.planner.spec import (
    ADAMW,
    DEFAULT_MODEL_OPTIONS,
    MATRIX,
    NAMING_CONVENTIONS,
    OPTIMIZER_CLASSES,
    QKV_SPLITS,
    ModelOptions,
    ParamSpec,
    PlanError,
    fused_row_blocks,
)
from canzona.schedules.limits import MAX_PARAMS
from canzona.schedules.splits import qkv_row_blocks

VOCAB_DIVISOR = 128
"""Megatron's default `--make-vocab-size-divisible-by`; the vocab is padded to this times TP."""

Shape = tuple[int, ...]
Submatrices = tuple[tuple[int, int], ...]
RowBlocks = tuple[tuple[tuple[int, int], ...], ...]


def _qwen3(h: int, ffn: int, layers: int, heads: int, tied: bool) -> Architecture:
    return Architecture(h, ffn, layers, heads, 8, 128, 151936, tied_embeddings=tied, qk_norm=True, family="qwen3")


def _qwen3_moe(h: int, ffn: int, layers: int, heads: int, expert_ffn: int) -> Architecture:
    return Architecture(
        h,
        ffn,
        layers,
        heads,
        4,
        128,
        151936,
        qk_norm=True,
        num_experts=128,
        top_k=8,
        expert_ffn=expert_ffn,
        family="qwen3_moe",
    )


def _llama3(h: int, ffn: int, layers: int, heads: int) -> Architecture:
    return Architecture(h, ffn, layers, heads, 8, 128, 128256, family="llama")


PRESETS: dict[str, Architecture] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tied=True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tied=True),
    "qwen3-4b": _qwen3(2560, 9728, 36, 32, tied=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tied=False),
    "qwen3-14b": _qwen3(5120, 17408, 40, 40, tied=False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, tied=False),
    # ffn is the (unused) dense size from the HF config: every layer is MoE.
    "qwen3-30b-a3b": _qwen3_moe(2048, 6144, 48, 32, expert_ffn=768),
    "qwen3-235b-a22b": _qwen3_moe(4096, 12288, 94, 64, expert_ffn=1536),
    "llama3.1-8b": _llama3(4096, 14336, 32, 32),
    "llama3.1-70b": _llama3(8192, 28672, 80, 64),
    "llama3.1-405b": _llama3(16384, 53248, 126, 128),
    "deepseek-v3": Architecture(
        7168,
        18432,
        61,
        128,
        128,
        192,
        129280,
        num_experts=256,
        top_k=8,
        expert_ffn=2048,
        num_shared_experts=1,
        shared_expert_ffn=2048,
        first_dense_layers=3,
        q_lora=1536,
        kv_lora=512,
        qk_nope=128,
        qk_rope=64,
        v_head=128,
        family="deepseek_v3",
    ),
    "mixtral-8x7b": Architecture(
        4096, 14336, 32, 32, 8, 128, 32000, num_experts=8, top_k=2, expert_ffn=14336, family="mixtral"
    ),
}


def padded_vocab(vocab: int, tp: int) -> int:
    """Megatron's padded vocab size: `vocab` rounded up to a multiple of 128·tp."""
    multiple = VOCAB_DIVISOR * tp
    return -(-vocab // multiple) * multiple


def enumerate_params(
    name: str, arch: Architecture, tp: int, options: ModelOptions = DEFAULT_MODEL_OPTIONS
) -> tuple[ParamSpec, ...]:
    """The parameters of `arch` at TP size `tp` under `options.names`, in registration order.

    Megatron-core (the default, Transformer Engine's layer spec; `megatron-local` its local
    spec): shapes are full (unsharded), with the vocab padded to a multiple of 128·tp.
    transformers and torchtitan: `conventions.expand_named`. Raises PlanError when `tp` does
    not divide a dimension the stack splits, or on bad options.
    """
    check_tp_size(name, tp)
    _check_options(options)
    if options.names in MEGATRON_NAMES:
        _check_tp(name, arch, tp)
    if options.names == MEGATRON_LOCAL and arch.is_mla:
        raise PlanError(
            f"{name}: megatron-local names of multi-latent attention are not in the catalog (Megatron's "
            "local spec builds it on CUDA only); plan the live model, or --names megatron for TE's spec"
        )
    count = num_param_entries(arch, options)
    if count > MAX_PARAMS:
        raise PlanError(
            f"{name}: {count} parameters ({arch.num_layers} layers) is above canzona's maximum of {MAX_PARAMS}"
        )
    if options.names not in MEGATRON_NAMES:
        return tuple(expand_named(arch, options, tp))
    return _expand(arch, options, tp, padded_vocab(arch.vocab, tp))


def num_param_entries(arch: Architecture, options: ModelOptions = DEFAULT_MODEL_OPTIONS) -> int:
    """How many parameters `enumerate_params` lists for `arch`, without listing them (grouped
    expert tensors count one entry per expert)."""
    if options.names not in MEGATRON_NAMES:
        return num_named_entries(arch, options)
    attention = len(_mla_attention(arch) if arch.is_mla else _attention(arch, options))
    moe_layers = sum(1 for layer in range(arch.num_layers) if arch.is_moe_layer(layer))
    moe_mlp = 2 + 2 * arch.num_experts + (2 if arch.num_shared_experts else 0)
    dense_mlp = 3
    globals_ = 2 + (0 if arch.tied_embeddings else 1)  # embedding, final norm, output layer
    return globals_ + arch.num_layers * attention + moe_layers * moe_mlp + (arch.num_layers - moe_layers) * dense_mlp


def count_params(arch: Architecture) -> int:
    """Total parameter count of `arch` at tp=1, before vocab padding."""
    return sum(p.numel for p in _expand(arch, ModelOptions(), 1, arch.vocab))


def check_tp_size(name: str, tp: int) -> None:
    """Raise PlanError unless `tp` is an integer >= 1 (`name` labels the message)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise PlanError(f"{name}: tp must be an integer >= 1, got {tp!r}")


def _check_tp(name: str, arch: Architecture, tp: int) -> None:
    check_tp_size(name, tp)
    sizes = {"num_heads": arch.num_heads}
    if not arch.is_mla:
        sizes["num_kv_groups"] = arch.num_kv_groups
    if arch.has_dense_layer:
        sizes["ffn"] = arch.ffn
    if arch.has_moe_layer:
        sizes["expert_ffn"] = arch.expert_ffn
        if arch.num_shared_experts:
            sizes["shared_expert_ffn"] = arch.shared_expert_ffn
    for field_name, size in sizes.items():
        if size % tp:
            raise PlanError(f"{name}: tp {tp} does not divide {field_name} {size}")


def _check_options(options: ModelOptions) -> None:
    if options.split_qkv not in QKV_SPLITS:
        raise PlanError(f"unknown split_qkv {options.split_qkv!r}; expected one of {', '.join(QKV_SPLITS)}")
    if options.names not in NAMING_CONVENTIONS:
        raise PlanError(f"unknown naming convention {options.names!r}; expected one of {', '.join(NAMING_CONVENTIONS)}")
    if options.router_optimizer not in OPTIMIZER_CLASSES:
        raise PlanError(
            f"unknown router_optimizer {options.router_optimizer!r}; expected one of {', '.join(OPTIMIZER_CLASSES)}"
        )


def _expand(arch: Architecture, options: ModelOptions, tp: int, vocab_rows: int) -> tuple[ParamSpec, ...]:
    params = [_adamw("embedding.word_embeddings.weight", (vocab_rows, arch.h), 0)]
    local = options.names == MEGATRON_LOCAL
    for layer in range(arch.num_layers):
        prefix = f"decoder.layers.{layer}."
        attention = _mla_attention(arch) if arch.is_mla else _attention(arch, options)
        params += [_prefixed(prefix, p) for p in (_local_attention(attention) if local else attention)]
        mlp = _moe_mlp(arch, options, tp) if arch.is_moe_layer(layer) else _dense_mlp(arch, options, tp)
        params += [_prefixed(prefix, p) for p in (_local_mlp(mlp) if local else mlp)]
    params.append(_adamw("decoder.final_layernorm.weight", (arch.h,), None))
    if not arch.tied_embeddings:
        params.append(_adamw("output_layer.weight", (vocab_rows, arch.h), 0))
    return tuple(params)


def _local_attention(params: list[ParamSpec]) -> list[ParamSpec]:
    """Megatron's local spec: the input norm is the layer's own `input_layernorm`, registered
    first, not Transformer Engine's `linear_qkv.layer_norm_weight`."""
    norm = next(p for p in params if p.name.endswith("linear_qkv.layer_norm_weight"))
    return [replace(norm, name="input_layernorm.weight"), *(p for p in params if p is not norm)]


_TE_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def _local_mlp(params: list[ParamSpec]) -> list[ParamSpec]:
    """Megatron's local spec: a dense MLP's input norm is `pre_mlp_layernorm`, and routed
    experts are a SequentialMLP, `mlp.experts.local_experts.<e>.linear_fc1/2.weight` expert by
    expert (Transformer Engine's grouped MLP lists every fc1, then every fc2)."""
    out, experts = [], []
    for param in params:
        expert = _TE_EXPERT.match(param.name)
        if expert:
            experts.append(replace(param, name=f"mlp.experts.local_experts.{expert[2]}.{expert[1]}.weight"))
            continue
        if experts:
            out += sorted(experts, key=lambda p: p.expert_index or 0)  # stable: fc1 before fc2 of each expert
            experts = []
        out.append(
            replace(param, name="pre_mlp_layernorm.weight")
            if param.name == "mlp.linear_fc1.layer_norm_weight"
            else param
        )
    return out + sorted(experts, key=lambda p: p.expert_index or 0)


def _prefixed(prefix: str, param: ParamSpec) -> ParamSpec:
    return replace(param, name=prefix + param.name)


def _adamw(name: str, shape: Shape, tp_dim: int | None) -> ParamSpec:
    return ParamSpec(name, shape, tp_dim, ADAMW)


def _matrix(
    name: str,
    shape: tuple[int, int],
    tp_dim: int | None,
    submatrices: Submatrices | None = None,
    expert: tuple[int, int] | None = None,
    row_blocks: RowBlocks = (),
) -> ParamSpec:
    index, count = expert if expert is not None else (None, 0)
    return ParamSpec(
        name,
        shape,
        tp_dim,
        MATRIX,
        submatrices or (shape,),
        expert_index=index,
        num_experts=count,
        row_blocks=row_blocks,
    )


def _qkv_submatrices(arch: Architecture, split: str) -> Submatrices:
    q_rows = arch.num_heads * arch.head_dim
    kv_rows = arch.num_kv_groups * arch.head_dim
    if split == "qkv":
        return ((q_rows, arch.h), (kv_rows, arch.h), (kv_rows, arch.h))
    if split == "head":
        return ((arch.head_dim, arch.h),) * (arch.num_heads + 2 * arch.num_kv_groups)
    return ((q_rows + 2 * kv_rows, arch.h),)


def _qkv_row_blocks(arch: Architecture, split: str) -> RowBlocks:
    """Megatron groups QKV rows per KV group as [q heads, k, v]; shards split on groups, so
    the gathered matrix is the canonical one."""
    return qkv_row_blocks(arch.num_kv_groups, arch.num_heads // arch.num_kv_groups, arch.head_dim, split)


def _fc1_row_blocks(ffn: int, tp: int, split: bool) -> RowBlocks:
    """Each TP shard of fc1 holds [gate shard; up shard]: gathered rows interleave them."""
    return fused_row_blocks(2 * ffn, 2, tp, split)


def _attention(arch: Architecture, options: ModelOptions) -> list[ParamSpec]:
    qkv_rows = (arch.num_heads + 2 * arch.num_kv_groups) * arch.head_dim
    params = [
        _matrix("self_attention.linear_proj.weight", (arch.h, arch.num_heads * arch.head_dim), 1),
        _adamw("self_attention.linear_qkv.layer_norm_weight", (arch.h,), None),
        _matrix(
            "self_attention.linear_qkv.weight",
            (qkv_rows, arch.h),
            0,
            _qkv_submatrices(arch, options.split_qkv),
            row_blocks=_qkv_row_blocks(arch, options.split_qkv),
        ),
    ]
    if arch.qkv_bias:
        params.append(_adamw("self_attention.linear_qkv.bias", (qkv_rows,), 0))
    if arch.qk_norm:
        params.append(_adamw("self_attention.q_layernorm.weight", (arch.head_dim,), None))
        params.append(_adamw("self_attention.k_layernorm.weight", (arch.head_dim,), None))
    return params


def _mla_attention(arch: Architecture) -> list[ParamSpec]:
    heads = arch.num_heads
    q_rows = heads * (arch.qk_nope + arch.qk_rope)
    params = [
        _adamw("input_layernorm.weight", (arch.h,), None),
        _matrix("self_attention.linear_proj.weight", (arch.h, heads * arch.v_head), 1),
    ]
    if arch.q_lora:
        params += [
            _matrix("self_attention.linear_q_down_proj.weight", (arch.q_lora, arch.h), None),
            _adamw("self_attention.linear_q_up_proj.layer_norm_weight", (arch.q_lora,), None),
            _matrix("self_attention.linear_q_up_proj.weight", (q_rows, arch.q_lora), 0),
        ]
    else:
        params.append(_matrix("self_attention.linear_q_proj.weight", (q_rows, arch.h), 0))
    params += [
        _matrix("self_attention.linear_kv_down_proj.weight", (arch.kv_lora + arch.qk_rope, arch.h), None),
        _adamw("self_attention.linear_kv_up_proj.layer_norm_weight", (arch.kv_lora,), None),
        _matrix(
            "self_attention.linear_kv_up_proj.weight",
            (heads * (arch.qk_nope + arch.v_head), arch.kv_lora),
            0,
        ),
    ]
    return params


def _fc_pair(
    prefix: str,
    h: int,
    ffn: int,
    options: ModelOptions,
    tp: int,
    suffix: str = "",
    expert: tuple[int, int] | None = None,
) -> tuple[ParamSpec, ParamSpec]:
    """fc1 [2F, h] (gate rows then up rows) and fc2 [h, F] of one gated MLP."""
    fc1_subs = ((ffn, h), (ffn, h)) if options.split_fc1 else None
    blocks = _fc1_row_blocks(ffn, tp, options.split_fc1)
    fc1 = _matrix(f"{prefix}linear_fc1.weight{suffix}", (2 * ffn, h), 0, fc1_subs, expert, blocks)
    fc2 = _matrix(f"{prefix}linear_fc2.weight{suffix}", (h, ffn), 1, expert=expert)
    return fc1, fc2


def _dense_mlp(arch: Architecture, options: ModelOptions, tp: int) -> list[ParamSpec]:
    fc1, fc2 = _fc_pair("mlp.", arch.h, arch.ffn, options, tp)
    return [_adamw("mlp.linear_fc1.layer_norm_weight", (arch.h,), None), fc1, fc2]


def _moe_mlp(arch: Architecture, options: ModelOptions, tp: int) -> list[ParamSpec]:
    router_shape = (arch.num_experts, arch.h)
    router_subs = (router_shape,) if options.router_optimizer == MATRIX else ()
    params = [
        _adamw("pre_mlp_layernorm.weight", (arch.h,), None),
        ParamSpec("mlp.router.weight", router_shape, None, options.router_optimizer, router_subs),
    ]
    # TEGroupedMLP registers weight0..weightE-1 of fc1, then those of fc2.
    pairs = [
        _fc_pair("mlp.experts.", arch.h, arch.expert_ffn, options, tp, str(i), (i, arch.num_experts))
        for i in range(arch.num_experts)
    ]
    params += [fc1 for fc1, _ in pairs] + [fc2 for _, fc2 in pairs]
    if arch.num_shared_experts:
        params += _fc_pair("mlp.shared_experts.", arch.h, arch.shared_expert_ffn, options, tp)
    return params
