"""Hugging Face (transformers) and torchtitan parameter lists of catalog architectures.

The catalog's own expansion (`catalog.enumerate_params`) gives Megatron-core's names. A model
written with transformers or torchtitan (0.3.0) registers other parameters: separate Q, K, V
(transformers) or a fused `wqkv` grouped per KV head (torchtitan), separate gate/up projections,
per-layer norms at the end of the block, and MoE experts as grouped 3-D tensors
`[E, rows, cols]`. `expand_named` lists them in `named_parameters()` order, with the TP dims
each stack's own tensor-parallel plan shards (colwise → dim 0, rowwise → dim 1; for 3-D experts
the same dims of each expert slice) and each grouped expert tensor as its E expert slices
(`ParamSpec.parent`). Nothing is padded: the vocab dim must divide by TP.

Which gradients are partial sums over TP (`ParamSpec.grad_reduce`):
- hf: none by default. transformers all-reduces q_norm/k_norm gradients itself
  (`replicated_with_grad_allreduce` in its TP plan); `sequence_parallel` marks every norm.
- torchtitan: none by default. Its TP plan leaves the norms' gradients partial sums over TP
  (sequence parallelism; q_norm/k_norm over split heads), but torchtitan always wraps the model
  in FSDP2, whose gradient reduction completes them over TP before any optimizer sees them;
  `sequence_parallel` marks every norm, for a model parallelized without FSDP2.
"""

from __future__ import annotations

from dataclasses import replace

from canzona.planner.sources.architecture import Architecture
from canzona.planner.spec import ADAMW, MATRIX, ModelOptions, ParamSpec, PlanError, fused_row_blocks
from canzona.schedules.splits import head_row_blocks, qkv_row_blocks, submatrices

MEGATRON, MEGATRON_LOCAL, HF, TORCHTITAN = "megatron", "megatron-local", "hf", "torchtitan"
MEGATRON_NAMES = (MEGATRON, MEGATRON_LOCAL)  # Megatron-core with Transformer Engine's layer spec, or its local spec
PARTIAL_OVER_TP = "tp"
ROUTER_FIRST_FAMILIES = ("mixtral",)  # transformers registers their router before the experts

Shape = tuple[int, ...]
RowBlocks = tuple[tuple[tuple[int, int], ...], ...]


def expand_named(arch: Architecture, options: ModelOptions, tp: int) -> list[ParamSpec]:
    """The parameters of `arch` under `options.names` ("hf" or "torchtitan"), in registration
    order, full (unsharded) shapes; PlanError when TP does not divide the attention heads or
    the stack has no such model (other dims TP may shard unevenly)."""
    check_named(arch, options, tp)
    layer_params = _hf_layer if options.names == HF else _torchtitan_layer
    params = [
        _adamw("model.embed_tokens.weight" if options.names == HF else "tok_embeddings.weight", (arch.vocab, arch.h), 0)
    ]
    prefix = "model.layers." if options.names == HF else "layers."
    for layer in range(arch.num_layers):
        params += [_prefixed(f"{prefix}{layer}.", p) for p in layer_params(arch, options, tp, arch.is_moe_layer(layer))]
    return params + _head(arch, options.names)


def num_named_entries(arch: Architecture, options: ModelOptions) -> int:
    """How many entries `expand_named` lists (expert slices counted one by one)."""
    layer_params = _hf_layer if options.names == HF else _torchtitan_layer
    moe_layers = sum(1 for layer in range(arch.num_layers) if arch.is_moe_layer(layer))
    per_moe = len(layer_params(arch, options, 1, True)) if moe_layers else 0
    per_dense = len(layer_params(arch, options, 1, False)) if moe_layers < arch.num_layers else 0
    return 1 + len(_head(arch, options.names)) + moe_layers * per_moe + (arch.num_layers - moe_layers) * per_dense


def check_named(arch: Architecture, options: ModelOptions, tp: int) -> None:
    """PlanError unless `arch` exists in the stack and TP divides its attention heads."""
    stack = options.names
    if options.split_qkv == "none" and stack == HF:
        raise PlanError(
            f"split_qkv none updates a fused QKV weight, which {stack} models do not have "
            "(their Q, K and V are separate parameters); use qkv or head"
        )
    if stack == TORCHTITAN and (arch.is_mla or arch.qkv_bias):
        feature = "multi-head latent attention" if arch.is_mla else "QKV biases"
        raise PlanError(
            f"torchtitan names: the catalog has no torchtitan model with {feature}; use --names hf or megatron"
        )
    if arch.is_mla:  # transformers' plan for DeepSeek-V3 leaves attention replicated
        return
    # DTensor shards every other dim unevenly (torch.chunk), but attention splits whole heads
    for field_name, size in (("num_heads", arch.num_heads), ("num_kv_groups", arch.num_kv_groups)):
        if size % tp:
            raise PlanError(
                f"{stack} names: tp {tp} does not divide {field_name} {size} "
                "(each TP rank computes whole attention heads)"
            )


def mark_partial_norms(params: list[ParamSpec]) -> list[ParamSpec]:
    """Every norm (a replicated 1-D parameter with "norm" in its name) marked as having a
    gradient that is a partial sum over TP, as under sequence parallelism."""
    return [replace(p, grad_reduce=PARTIAL_OVER_TP) if is_norm(p) else p for p in params]


def is_norm(param: ParamSpec) -> bool:
    """Whether `param` is a norm's weight or bias: 1-D, replicated over TP, "norm" in its name."""
    return param.optimizer == ADAMW and len(param.shape) == 1 and param.tp_dim is None and "norm" in param.name.lower()


# ---------------------------------------------------------------------------------------------
# Building blocks


def _adamw(name: str, shape: Shape, tp_dim: int | None) -> ParamSpec:
    return ParamSpec(name, shape, tp_dim, ADAMW)


def _matrix(
    name: str,
    shape: tuple[int, int],
    tp_dim: int | None,
    submatrices: tuple[tuple[int, int], ...] = (),
    row_blocks: RowBlocks = (),
) -> ParamSpec:
    return ParamSpec(name, shape, tp_dim, MATRIX, submatrices or (shape,), row_blocks=row_blocks)


def _prefixed(prefix: str, param: ParamSpec) -> ParamSpec:
    parent = None if param.parent is None else prefix + param.parent
    return replace(param, name=prefix + param.name, parent=parent)


def _grouped(name: str, num_experts: int, template: ParamSpec) -> list[ParamSpec]:
    """A grouped expert tensor [E, *template.shape] as its E expert slices."""
    return [
        replace(template, name=f"{name}[{e}]", parent=name, expert_index=e, num_experts=num_experts)
        for e in range(num_experts)
    ]


def _projection(name: str, rows: int, cols: int, head_dim: int, split: str) -> ParamSpec:
    """Q, K or V ([rows, cols], split on dim 0): one matrix, or one submatrix per head."""
    heads = rows // head_dim
    if split != "head" or heads == 1:
        return _matrix(name, (rows, cols), 0)
    return _matrix(name, (rows, cols), 0, ((head_dim, cols),) * heads, head_row_blocks(rows, head_dim))


def _hf_mlp(prefix: str, h: int, ffn: int) -> list[ParamSpec]:
    """transformers' gated MLP: gate_proj, up_proj (colwise), down_proj (rowwise)."""
    return [
        _matrix(f"{prefix}gate_proj.weight", (ffn, h), 0),
        _matrix(f"{prefix}up_proj.weight", (ffn, h), 0),
        _matrix(f"{prefix}down_proj.weight", (h, ffn), 1),
    ]


def _torchtitan_ffn(prefix: str, h: int, ffn: int) -> list[ParamSpec]:
    """torchtitan's FeedForward: w1 (gate, colwise), w2 (down, rowwise), w3 (up, colwise)."""
    return [
        _matrix(f"{prefix}w1.weight", (ffn, h), 0),
        _matrix(f"{prefix}w2.weight", (h, ffn), 1),
        _matrix(f"{prefix}w3.weight", (ffn, h), 0),
    ]


def _head(arch: Architecture, stack: str) -> list[ParamSpec]:
    """The final norm and, unless tied to the embedding, the output projection."""
    params = [_adamw("model.norm.weight" if stack == HF else "norm.weight", (arch.h,), None)]
    if not arch.tied_embeddings:
        params.append(_adamw("lm_head.weight", (arch.vocab, arch.h), 0))
    return params


def _router(name: str, arch: Architecture, options: ModelOptions) -> ParamSpec:
    shape = (arch.num_experts, arch.h)
    return ParamSpec(
        name, shape, None, options.router_optimizer, (shape,) if options.router_optimizer == MATRIX else ()
    )


# ---------------------------------------------------------------------------------------------
# transformers


def _hf_layer(arch: Architecture, options: ModelOptions, tp: int, moe: bool) -> list[ParamSpec]:
    attention = _hf_mla(arch) if arch.is_mla else _hf_attention(arch, options)
    mlp = _hf_moe(arch, options, tp) if moe else _hf_mlp("mlp.", arch.h, arch.ffn)
    norms = [
        _adamw("input_layernorm.weight", (arch.h,), None),
        _adamw("post_attention_layernorm.weight", (arch.h,), None),
    ]
    return attention + mlp + norms


def _hf_attention(arch: Architecture, options: ModelOptions) -> list[ParamSpec]:
    d = arch.head_dim
    q_rows, kv_rows = arch.num_heads * d, arch.num_kv_groups * d
    params = []
    for proj, rows in (("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)):
        params.append(_projection(f"self_attn.{proj}.weight", rows, arch.h, d, options.split_qkv))
        if arch.qkv_bias:
            params.append(_adamw(f"self_attn.{proj}.bias", (rows,), 0))
    params.append(_matrix("self_attn.o_proj.weight", (arch.h, q_rows), 1))
    if arch.qk_norm:
        params += [_adamw("self_attn.q_norm.weight", (d,), None), _adamw("self_attn.k_norm.weight", (d,), None)]
    return params


def _hf_mla(arch: Architecture) -> list[ParamSpec]:
    """DeepSeek-V3 attention; transformers' TP plan for it leaves every attention weight replicated."""
    heads, q_rows = arch.num_heads, arch.num_heads * (arch.qk_nope + arch.qk_rope)
    if arch.q_lora:
        params = [
            _matrix("self_attn.q_a_proj.weight", (arch.q_lora, arch.h), None),
            _adamw("self_attn.q_a_layernorm.weight", (arch.q_lora,), None),
            _matrix("self_attn.q_b_proj.weight", (q_rows, arch.q_lora), None),
        ]
    else:
        params = [_matrix("self_attn.q_proj.weight", (q_rows, arch.h), None)]
    return params + [
        _matrix("self_attn.kv_a_proj_with_mqa.weight", (arch.kv_lora + arch.qk_rope, arch.h), None),
        _adamw("self_attn.kv_a_layernorm.weight", (arch.kv_lora,), None),
        _matrix("self_attn.kv_b_proj.weight", (heads * (arch.qk_nope + arch.v_head), arch.kv_lora), None),
        _matrix("self_attn.o_proj.weight", (arch.h, heads * arch.v_head), None),
    ]


def _hf_moe(arch: Architecture, options: ModelOptions, tp: int) -> list[ParamSpec]:
    """Routed experts as grouped tensors: gate_up_proj [E, 2F, h] (packed colwise: each TP
    shard holds [gate shard; up shard]) and down_proj [E, h, F] (rowwise); the router; shared
    experts (DeepSeek-V3)."""
    h, ffn, experts = arch.h, arch.expert_ffn, arch.num_experts
    blocks = fused_row_blocks(2 * ffn, 2, tp, options.split_fc1)
    gate_up = _matrix("", (2 * ffn, h), 0, ((ffn, h), (ffn, h)) if options.split_fc1 else (), blocks)
    grouped = _grouped("mlp.experts.gate_up_proj", experts, gate_up) + _grouped(
        "mlp.experts.down_proj", experts, _matrix("", (h, ffn), 1)
    )
    router = [_router("mlp.gate.weight", arch, options)]
    shared = []
    if arch.num_shared_experts:
        shared = _hf_mlp("mlp.shared_experts.", h, arch.shared_expert_ffn)
    routed = router + grouped if arch.family in ROUTER_FIRST_FAMILIES else grouped + router
    return routed + shared


# ---------------------------------------------------------------------------------------------
# torchtitan


def _torchtitan_layer(arch: Architecture, options: ModelOptions, tp: int, moe: bool) -> list[ParamSpec]:
    """torchtitan 0.3.0's block: the fused `qkv_linear.wqkv` (rows per KV head [q heads, k, v],
    colwise), `wo`, the q/k norms, the MLP or MoE, then the block's two norms."""
    d, h = arch.head_dim, arch.h
    heads_per_group = arch.num_heads // arch.num_kv_groups
    rows = (arch.num_heads + 2 * arch.num_kv_groups) * d
    blocks = qkv_row_blocks(arch.num_kv_groups, heads_per_group, d, options.split_qkv)
    attention = [
        _matrix("attention.qkv_linear.wqkv.weight", (rows, h), 0, tuple(submatrices((rows, h), blocks)), blocks),
        _matrix("attention.wo.weight", (h, arch.num_heads * d), 1),
    ]
    if arch.qk_norm:
        attention += [_adamw("attention.q_norm.weight", (d,), None), _adamw("attention.k_norm.weight", (d,), None)]
    mlp = _torchtitan_moe(arch, options) if moe else _torchtitan_ffn("feed_forward.", h, arch.ffn)
    norms = [_adamw("attention_norm.weight", (h,), None), _adamw("ffn_norm.weight", (h,), None)]
    return attention + mlp + norms


def _torchtitan_moe(arch: Architecture, options: ModelOptions) -> list[ParamSpec]:
    """Routed experts w1_EFD, w3_EFD [E, F, h] (TP: Shard(1)) and w2_EDF [E, h, F] (Shard(2)),
    the router gate, shared experts."""
    h, ffn, experts = arch.h, arch.expert_ffn, arch.num_experts
    prefix = "moe.routed_experts.inner_experts."
    params = (
        _grouped(f"{prefix}w1_EFD", experts, _matrix("", (ffn, h), 0))
        + _grouped(f"{prefix}w2_EDF", experts, _matrix("", (h, ffn), 1))
        + _grouped(f"{prefix}w3_EFD", experts, _matrix("", (ffn, h), 0))
        + [_router("moe.router.gate.weight", arch, options)]
    )
    if arch.num_shared_experts:
        params += _torchtitan_ffn("moe.shared_experts.", h, arch.shared_expert_ffn)
    return params
