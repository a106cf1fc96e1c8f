"""Megatron-core: what canzona reads from its models, and what a Megatron training loop needs
around `CanzonaOptimizer` (docs/megatron.md).

**Models.** Megatron-core's tensor-parallel layers (`ColumnParallelLinear`,
`RowParallelLinear`, `VocabParallelEmbedding`, and Transformer Engine's) hold plain tensors,
each rank its shard, marked with attributes: `tensor_model_parallel` (split over TP),
`partition_dim` (the dim split) and `partition_stride` (s > 1: each shard holds s equal row
parts, fc1's [gate; up] under a gated MLP); `is_embedding_or_output_parameter` marks the
embedding and the output layer. The TP size is the model's `TransformerConfig.
tensor_model_parallel_size`, and `linear_qkv` holds its rows per query group as [q heads, k, v],
with `num_attention_heads`, `num_query_groups` and `kv_channels` from the same config.
`canzona.runtime.tools.describe` reads all of it through this module.

**Training.** `finalize_model_grads` replaces Megatron's `finalize_model_grads_func`: it runs
Megatron's TP-side gradient sums and leaves the DP reduction to canzona. `optimizer_kwargs`
and `param_groups` turn Megatron's `OptimizerConfig` for Muon into canzona's hyperparameters
and groups, so that the same numbers give the same training; `plan_options` says what the
schedule must be planned with. Nothing here imports Megatron at module level: models and configs
are read by their attributes, and only `finalize_model_grads` asks Megatron for its process groups.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from canzona.schedules.coefficients import NS_COEFFICIENT_NAMES
from canzona.schedules.format import Schedule

QKV_SUFFIX = "linear_qkv.weight"
MEGATRON_COEFFICIENTS = "quintic"  # TensorParallelMuon's default coefficient_type (0.16 has no option for it)
NS_PRECISION = {"medium": "bf16", "high": "tf32", "highest": "fp32"}  # muon_fp32_matmul_prec -> ns_dtype
SCALE_MODES = {"spectral": "spectral", "shape_scaling": "shape", "unit_rms_norm": "unit_rms"}  # muon_scale_mode
TP_MODES = ("duplicated", "distributed", "blockwise")  # muon_tp_mode


class MegatronConfigError(ValueError):
    """A Megatron model or optimizer setting canzona cannot reproduce (one-line message)."""


# ---------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True)
class TpLayout:
    """How Megatron splits one parameter over TP: the dim, and the row parts each shard holds."""

    dim: int
    stride: int = 1


def tp_layout(param: torch.Tensor) -> TpLayout | None:
    """The TP split Megatron marks on `param` (None: not split over TP)."""
    if not getattr(param, "tensor_model_parallel", False):
        return None
    dim = getattr(param, "partition_dim", -1)
    if dim == -1:
        return None
    return TpLayout(int(dim), int(getattr(param, "partition_stride", 1) or 1))


def model_config(model: nn.Module) -> Any | None:
    """The `TransformerConfig` of a Megatron-core model (the first module carrying one), or None."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "tensor_model_parallel_size"):
            return config
    return None


def is_megatron(model: nn.Module) -> bool:
    """Whether `model` holds parameters Megatron's TP attributes describe."""
    return any(hasattr(param, "tensor_model_parallel") for param in model.parameters())


def tp_size(model: nn.Module) -> int:
    """The TP size a Megatron-core model was built for (MegatronConfigError when it carries no
    config, or its experts are split otherwise than its dense layers)."""
    config = model_config(model)
    if config is None:
        raise MegatronConfigError(
            "the model's parameters carry Megatron's tensor_model_parallel attributes but no "
            "module carries a TransformerConfig to read the TP size from"
        )
    size = int(config.tensor_model_parallel_size)
    expert_tp = getattr(config, "expert_tensor_parallel_size", None)
    if getattr(config, "num_moe_experts", None) and expert_tp not in (None, size):
        raise MegatronConfigError(
            f"expert_tensor_parallel_size {expert_tp} differs from tensor_model_parallel_size "
            f"{size}: canzona plans experts at the model's TP size"
        )
    if getattr(config, "expert_model_parallel_size", 1) > 1:
        raise MegatronConfigError(
            "a live model under expert parallelism holds only its own experts: describe it at "
            "expert_model_parallel_size 1, or plan a preset or config.json with --names megatron "
            "and --ep"
        )
    return size


def global_shape(param: torch.Tensor, layout: TpLayout, size: int) -> tuple[int, ...]:
    """The full shape of a parameter whose local shard `param` is, split as `layout` over `size` ranks."""
    shape = list(param.shape)
    shape[layout.dim] *= size
    return tuple(shape)


def qkv_layout(name: str, owner: nn.Module, config: Any) -> dict[str, int] | None:
    """`{query_groups, heads, head_dim}` of Megatron's fused `linear_qkv` weight `name` (rows
    grouped per query group as [q heads, k, v]), read from its module's config; None for any
    other parameter."""
    if not name.endswith(QKV_SUFFIX):
        return None
    config = getattr(owner, "config", None) or config
    heads = getattr(config, "num_attention_heads", None)
    if not heads or getattr(config, "multi_latent_attention", False):
        return None
    groups = getattr(config, "num_query_groups", None) or heads
    head_dim = getattr(config, "kv_channels", None) or config.hidden_size // heads
    return {"query_groups": int(groups), "heads": int(heads), "head_dim": int(head_dim)}


def is_embedding_or_output(param: torch.Tensor) -> bool:
    """Whether Megatron marks `param` as the embedding or the output layer (AdamW's, as in
    Megatron's Muon)."""
    return bool(getattr(param, "is_embedding_or_output_parameter", False))


# ---------------------------------------------------------------------------------------------
# The gradients: Megatron's TP-side sums, canzona's DP reduction


def _needs_tp_sum(name: str, param: torch.Tensor, config: Any) -> str | None:
    """ "avg" or "sum" when Megatron all-reduces this parameter's gradient over TP in
    `finalize_model_grads` (sequence-parallel norms, qk-layernorms, parameters averaged across
    the TP domain), else None."""
    if getattr(param, "average_gradients_across_tp_domain", False):
        return "avg"
    if getattr(config, "sequence_parallel", False) and getattr(param, "sequence_parallel", False):
        return "sum"
    if getattr(config, "qk_layernorm", False) and ("q_layernorm" in name or "k_layernorm" in name):
        return "sum"
    return None


def _grad_of(param: torch.Tensor) -> torch.Tensor | None:
    return getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad


def _megatron_groups(pg_collection: Any) -> tuple[dist.ProcessGroup, dist.ProcessGroup, int]:
    """(TP group, DP group with context parallelism, pipeline size) of the run."""
    if pg_collection is not None:
        return pg_collection.tp, pg_collection.dp_cp, dist.get_world_size(pg_collection.pp)
    from megatron.core import parallel_state

    return (
        parallel_state.get_tensor_model_parallel_group(),
        parallel_state.get_data_parallel_group(with_context_parallel=True),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )


def finalize_model_grads(
    model: list[nn.Module],
    num_tokens: torch.Tensor | None = None,
    pg_collection: Any = None,
    force_all_reduce: bool | None = False,
) -> None:
    """Megatron's `finalize_model_grads` without its data-parallel reduction, which canzona does
    at its schedule's cuts: the TP sums Megatron runs (sequence-parallel norms, qk-layernorms,
    parameters it averages over the TP domain), on `.main_grad` (Megatron's DDP) or `.grad`;
    and with `num_tokens` (per-token loss) each rank's gradients scaled by DP size / the tokens
    of the whole DP group, so that canzona's DP mean is Megatron's sum over tokens. Set it as
    `config.finalize_model_grads_func`; `force_all_reduce` is accepted and has nothing to force.
    Pipeline parallelism is refused (canzona plans the whole model on every rank)."""
    tp_group, dp_group, pp_size = _megatron_groups(pg_collection)
    if pp_size > 1:
        raise MegatronConfigError("pipeline parallelism is not planned by canzona (a schedule covers the whole model)")
    sums: dict[str, list[torch.Tensor]] = {"sum": [], "avg": []}
    for chunk in model:
        config = model_config(chunk)
        for name, param in chunk.named_parameters():
            grad = _grad_of(param) if param.requires_grad else None
            if grad is None:
                continue
            kind = _needs_tp_sum(name, param, config)
            if kind is not None:
                sums[kind].append(grad)
    size = dist.get_world_size(tp_group)
    if size > 1:
        _sum_coalesced(sums["sum"], tp_group)
        _sum_coalesced(sums["avg"], tp_group)
        for grad in sums["avg"]:
            grad.div_(size)  # ReduceOp.AVG is NCCL's only
    if num_tokens is not None:
        total = num_tokens.clone()
        dist.all_reduce(total, group=dp_group)
        scale = dist.get_world_size(dp_group) / total.clamp_min(1)
        for grad in _grads(model):
            grad.mul_(scale.to(grad.dtype))


def _sum_coalesced(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum `grads` over `group` in place, one all-reduce per dtype (as Megatron coalesces them)."""
    for dtype in sorted({grad.dtype for grad in grads}, key=str):
        same = [grad for grad in grads if grad.dtype == dtype]
        flat = torch.cat([grad.reshape(-1) for grad in same])
        dist.all_reduce(flat, group=group)
        offset = 0
        for grad in same:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()


def _grads(model: list[nn.Module]) -> Iterator[torch.Tensor]:
    for chunk in model:
        for param in chunk.parameters():
            grad = _grad_of(param) if param.requires_grad else None
            if grad is not None:
                yield grad


# ---------------------------------------------------------------------------------------------
# Megatron's Muon options as canzona's


def _check_config(config: Any, tp: int) -> None:
    optimizer = getattr(config, "optimizer", "muon")
    if optimizer not in ("muon", "adam"):  # get_megatron_muon_optimizer rewrites "muon" to "adam"
        raise MegatronConfigError(f"optimizer {optimizer!r}: the mapping is for Megatron's Muon")
    mode = getattr(config, "muon_tp_mode", "blockwise")
    if mode not in TP_MODES:
        raise MegatronConfigError(f"unknown muon_tp_mode {mode!r}; Megatron has {', '.join(TP_MODES)}")
    if mode == "blockwise" and tp > 1:
        raise MegatronConfigError(
            "muon_tp_mode 'blockwise' orthogonalises each TP shard on its own, so its update depends on the TP size; "
            "canzona updates every matrix whole, as Megatron's 'duplicated' and 'distributed' modes do: set "
            "muon_tp_mode='duplicated' (at TP 1 the modes agree)"
        )
    if getattr(config, "muon_fp32_matmul_prec", "medium") not in NS_PRECISION:
        raise MegatronConfigError(f"unknown muon_fp32_matmul_prec {config.muon_fp32_matmul_prec!r}")
    if getattr(config, "muon_scale_mode", "spectral") not in SCALE_MODES:
        raise MegatronConfigError(f"unknown muon_scale_mode {config.muon_scale_mode!r}")
    if not getattr(config, "decoupled_weight_decay", True):
        raise MegatronConfigError(
            "decoupled_weight_decay=False (Adam with L2): canzona's AdamW decays decoupled, as Megatron's default"
        )
    if getattr(config, "fp16", False):
        raise MegatronConfigError("fp16: Megatron's Muon refuses it too; train bf16 (canzona keeps fp32 main copies)")


def _nesterov(config: Any) -> bool:
    """Megatron's Nesterov flag (`muon_use_nesterov` in 0.16, `muon_nesterov` later; off by default)."""
    return bool(getattr(config, "muon_use_nesterov", getattr(config, "muon_nesterov", False)))


def plan_options(config: Any) -> dict[str, Any]:
    """The `canzona plan` settings Megatron's Muon runs with, as {option: value}: `ns_steps`
    (`muon_num_ns_steps`), `ns_coefficients` (`muon_coefficient_type` where the config has it,
    else Megatron's quintic) and `split_qkv` (`muon_split_qkv`: Q, K and V apart, or the fused
    matrix whole). MegatronConfigError for coefficients canzona does not have."""
    coefficients = getattr(config, "muon_coefficient_type", MEGATRON_COEFFICIENTS)
    if coefficients not in NS_COEFFICIENT_NAMES:
        raise MegatronConfigError(
            f"muon_coefficient_type {coefficients!r}: canzona has the {', '.join(NS_COEFFICIENT_NAMES)} coefficients"
        )
    return {
        "ns_steps": int(getattr(config, "muon_num_ns_steps", 5)),
        "ns_coefficients": coefficients,
        "split_qkv": "qkv" if getattr(config, "muon_split_qkv", True) else "none",
    }


def _plan_problem(config: Any, schedule: Schedule) -> str | None:
    req = schedule.request
    wanted = plan_options(config)
    found = {
        "ns_steps": req.optimizer.ns_steps,
        "ns_coefficients": req.optimizer.ns_coefficients,
        "split_qkv": req.split_qkv,
    }
    if req.optimizer.name != "muon":
        return f"the schedule is planned for {req.optimizer.name}, not Muon"
    wrong = [key for key in wanted if found[key] != wanted[key]]
    if not wrong:
        return None
    flags = " ".join(f"--{key.replace('_', '-')} {wanted[key]}" for key in wanted)
    return (
        f"the schedule's {', '.join(f'{k} {found[k]}' for k in wrong)} differ from Megatron's "
        f"{', '.join(f'{k} {wanted[k]}' for k in wrong)}: plan it with {flags}"
    )


def optimizer_kwargs(config: Any, schedule: Schedule) -> dict[str, Any]:
    """`CanzonaOptimizer` keyword arguments that make canzona's step Megatron-core's Muon step
    (`TensorParallelMuon`, with AdamW for the embedding, the output layer and the 1-D
    parameters) for its `OptimizerConfig` `config`: lr, weight decay, momentum and Nesterov,
    the Newton-Schulz precision, the update scale, AdamW's lr, betas and eps. `schedule` (its
    TP size, and the settings `plan_options` names) is checked against `config`;
    MegatronConfigError when it or the config cannot be reproduced."""
    _check_config(config, schedule.request.tp)
    problem = _plan_problem(config, schedule)
    if problem:
        raise MegatronConfigError(problem)
    lr, weight_decay = float(config.lr), float(getattr(config, "weight_decay", 0.0))
    return {
        "lr": lr,
        "weight_decay": weight_decay,
        "momentum": float(getattr(config, "muon_momentum", 0.95)),
        "nesterov": _nesterov(config),
        "ns_dtype": NS_PRECISION[getattr(config, "muon_fp32_matmul_prec", "medium")],
        "update_scale": SCALE_MODES[getattr(config, "muon_scale_mode", "spectral")],
        "update_scale_factor": float(getattr(config, "muon_extra_scale_factor", 1.0)),
        "adamw_lr": lr,
        "adamw_weight_decay": weight_decay,
        "adamw_betas": (float(getattr(config, "adam_beta1", 0.9)), float(getattr(config, "adam_beta2", 0.999))),
        "adamw_eps": float(getattr(config, "adam_eps", 1e-8)),
    }


def _skips_weight_decay(name: str, param: torch.Tensor, config: Any) -> bool:
    """Megatron's standard rule: no weight decay for 1-D parameters and biases (qk-layernorms
    keep it under `apply_wd_to_qk_layernorm`)."""
    skipped = param.dim() == 1 or name.endswith(".bias")
    if getattr(config, "apply_wd_to_qk_layernorm", False) and ("q_layernorm." in name or "k_layernorm." in name):
        return False
    return skipped


def param_groups(named_params: Iterable[tuple[str, torch.Tensor]], config: Any) -> list[dict[str, Any]]:
    """`CanzonaOptimizer` param groups with Megatron's weight-decay rule (`named_params`:
    `model.named_parameters()`): one group of the decayed parameters, one of the 1-D
    parameters and biases with `adamw_weight_decay` 0 (they are AdamW's), and with
    `decoupled_lr` the embedding and output layer in a group of their own with that AdamW lr.
    Every other hyperparameter comes from `optimizer_kwargs`."""
    decayed, skipped, decoupled = [], [], []
    decoupled_lr = getattr(config, "decoupled_lr", None)
    for name, param in named_params:
        if _skips_weight_decay(name, param, config):
            skipped.append((name, param))
        elif decoupled_lr is not None and is_embedding_or_output(param):
            decoupled.append((name, param))
        else:
            decayed.append((name, param))
    groups: list[dict[str, Any]] = [{"params": decayed}] if decayed else []
    if skipped:
        groups.append({"params": skipped, "adamw_weight_decay": 0.0})
    if decoupled_lr is not None and decoupled:
        groups.append({"params": decoupled, "adamw_lr": float(decoupled_lr)})
    return groups
