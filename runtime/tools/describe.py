"""Describe a live `nn.Module` as a canzona parameter list: names in `named_parameters()`
order, global shapes, dtypes, TP dims read from DTensor placements, grouped 3-D expert tensors
and parameters whose gradients are partial sums over TP.

Build the model on the meta device (`describe_factory` does): describing a 235B model then
costs no memory. The result is the parameter-list format the planner reads
(`canzona describe -o params.yaml` writes it; `canzona plan --model py:MODULE:FACTORY` plans
it directly). Only torch and the schedule format are imported: the planner never sees torch.

What is read from the module:
- TP dim: the `Shard(d)` placement of a DTensor parameter on the mesh dim named `tp`
  (`Replicate`: replicated; no such mesh dim, or a plain tensor: replicated). A strided shard
  (`_StridedShard`, e.g. transformers' packed gate/up experts) of split factor s is recorded as
  `fused: s`: each TP shard holds s equal row parts. Other mesh dims (FSDP's DP dims, EP) do
  not change the description: shapes are global.
- torchtitan's spmd_types backend (`canzona.runtime.integrations.titan`): plain tensors annotated
  with a partition spec and a local type per mesh axis; on the TP axis, `V` is a shard (its
  dim from the partition spec, the global shape from the axis size), `R` a replicated weight
  whose gradient is a partial sum over TP (`grad_reduce: tp`), `I` a replicated one. torchtitan's
  fused `qkv_linear.wqkv` gets `qkv:` from its `FusedQKVLinear`, as Megatron's below.
- Megatron-core's plain-tensor shards (`canzona.runtime.integrations.megatron`): the TP dim
  from `partition_dim`, the global shape from the model's TP size, `fused: s` from a
  `partition_stride` s > 1 (fc1's [gate; up]), and `linear_qkv`'s per-group layout as `qkv:`
  (its query groups, heads and head dim, from the model's config), which `--split-qkv` splits.
- Optimizer: 2-D parameters are matrices, except embeddings (`nn.Embedding`), the output head
  (the model's `get_output_embeddings()`, or a top-level `lm_head` / `output` / `output_layer`)
  and names holding "embed" or "norm"; in a Megatron-core model, Megatron's Muon rule: every
  2-D parameter but those marked `is_embedding_or_output_parameter`. 3-D parameters named
  "...expert..." are grouped experts [E, rows, cols] (one matrix per expert); everything else
  is AdamW's.
- Partial gradients (`grad_reduce: tp`): not visible in a parameter itself. They come from a
  `probe` (one forward and backward you provide: a replicated DTensor parameter whose gradient
  is `Partial` on the TP dim is marked), from `sequence_parallel` (every norm), or from
  `partial_grads` (name patterns). A model that sums such gradients itself is described
  without them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from canzona.runtime.integrations import megatron, titan
from canzona.schedules.format import compute_fingerprint, flow_value

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
TP_MESH_DIM = "tp"
OUTPUT_HEADS = ("lm_head", "output", "output_layer")
ADAMW_NAME_HINTS = ("embed", "norm")
PY_PREFIX = "py:"
PARTIAL_OVER_TP = "tp"


class DescribeError(ValueError):
    """A model that cannot be described (one-line message)."""


@dataclass(frozen=True)
class ParamDescription:
    """One parameter: global shape, dtype ("fp32"/"bf16"/"fp16"), TP dim, optimizer class,
    strided TP split factor (`fused`), grouped experts, partial gradient ("tp" or None), and a
    fused QKV weight's (query groups, heads, head dim)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    tp_dim: int | None
    optimizer: str
    fused: int | None = None
    grouped_experts: bool = False
    grad_reduce: str | None = None
    qkv: tuple[int, int, int] | None = None

    def to_entry(self) -> dict[str, Any]:
        """The parameter-list entry (optional keys only when set)."""
        entry: dict[str, Any] = {
            "name": self.name,
            "shape": list(self.shape),
            "tp_dim": self.tp_dim,
            "dtype": self.dtype,
            "optimizer": self.optimizer,
        }
        if self.fused is not None:
            entry["fused"] = self.fused
        if self.qkv is not None:
            entry["qkv"] = dict(zip(("query_groups", "heads", "head_dim"), self.qkv))
        if self.grouped_experts:
            entry["grouped_experts"] = True
        if self.grad_reduce is not None:
            entry["grad_reduce"] = self.grad_reduce
        return entry


@dataclass(frozen=True)
class ModuleDescription:
    """A live model's parameters in registration order; `tp` is the size of the TP mesh dim
    its DTensor parameters live on (None: no DTensor on a TP dim)."""

    name: str
    tp: int | None
    params: tuple[ParamDescription, ...]

    def with_dtype(self, dtype: str) -> ModuleDescription:
        """The same model with every parameter in `dtype` (as it trains, where it is built in
        another dtype: `canzona describe --dtype`)."""
        return replace(self, params=tuple(replace(p, dtype=dtype) for p in self.params))

    def to_data(self) -> dict[str, Any]:
        """The parameter-list document the planner reads."""
        data: dict[str, Any] = {"name": self.name}
        if self.tp is not None:
            data["tp"] = self.tp
        data["params"] = [p.to_entry() for p in self.params]
        return data

    def to_yaml(self) -> str:
        """The parameter list as YAML, one parameter per line (deterministic)."""
        head = [f"name: {flow_value(self.name)}"] + ([f"tp: {self.tp}"] if self.tp is not None else [])
        return "\n".join([*head, "params:", *(f"- {flow_value(p.to_entry())}" for p in self.params)]) + "\n"

    @property
    def sha256(self) -> str:
        """sha256 of the description (compact JSON): what a schedule records of a live model."""
        return hashlib.sha256(json.dumps(self.to_data(), separators=(",", ":")).encode()).hexdigest()

    @property
    def fingerprint(self) -> str:
        """The schedule fingerprint of this model (name, global shape, dtype, TP dim of each
        parameter): equal to the `fingerprint` of any schedule planned from it."""
        return compute_fingerprint((p.name, p.shape, p.dtype, p.tp_dim) for p in self.params)


@dataclass(frozen=True)
class _Context:
    """What describing one parameter needs of the whole model."""

    model: nn.Module
    owners: dict[int, nn.Module]
    heads: list[nn.Module]
    tp_mesh_dim: str
    sequence_parallel: bool
    megatron_tp: int | None
    spmd_axis: Any


def describe_module(
    model: nn.Module,
    *,
    name: str | None = None,
    tp_mesh_dim: str = TP_MESH_DIM,
    sequence_parallel: bool = False,
    partial_grads: Iterable[str] = (),
    probe: Callable[[nn.Module], Any] | None = None,
) -> ModuleDescription:
    """The description of `model` (see the module docstring). `name` defaults to the model's
    class name. `probe(model)` runs one forward and backward; gradients are read and cleared
    after it. `partial_grads`: fnmatch patterns of parameter names whose gradients are partial
    over TP. DescribeError on anything that cannot be described."""
    if probe is not None:
        probe(model)
    context = _Context(
        model,
        _owning_modules(model),
        _output_heads(model),
        tp_mesh_dim,
        sequence_parallel,
        _megatron_tp_size(model),
        _spmd_axis(model, tp_mesh_dim),
    )
    params, tp_sizes = [], set()
    for param_name, param in model.named_parameters():
        described, tp_size = _describe_param(param_name, param, context)
        params.append(described)
        if tp_size is not None:
            tp_sizes.add(tp_size)
    if probe is not None:
        model.zero_grad(set_to_none=True)
    if not params:
        raise DescribeError(f"model {name or type(model).__name__!r} has no parameters")
    if len(tp_sizes) > 1:
        raise DescribeError(
            f"the model's parameters live on {tp_mesh_dim!r} mesh dims of different sizes {sorted(tp_sizes)}"
        )
    patterned = _with_partial_patterns(params, list(partial_grads))
    return ModuleDescription(name or _class_name(model), next(iter(tp_sizes), None), tuple(patterned))


def _describe_param(name: str, param: torch.Tensor, context: _Context) -> tuple[ParamDescription, int | None]:
    """One parameter's description and the TP size its placement shows (None: no TP layout)."""
    tp_dim, fused, tp_size, partial = _tp_placement(name, param, context.tp_mesh_dim)
    shape = tuple(param.shape)
    owner = context.owners[id(param)]
    if not isinstance(param, DTensor) and context.megatron_tp is not None:
        tp_dim, fused, shape = _megatron_placement(param, context.megatron_tp)
        tp_size = context.megatron_tp
    elif not isinstance(param, DTensor) and context.spmd_axis is not None:
        tp_dim, tp_size, partial, shape = _spmd_placement(name, param, context.spmd_axis)
    qkv = _fused_qkv(name, shape, owner, context)
    grouped = param.ndim == 3 and "expert" in name.lower()
    adamw_2d = (
        megatron.is_embedding_or_output(param)
        if context.megatron_tp is not None
        else _adamw_2d(name, owner, context.heads)
    )
    optimizer = "matrix" if grouped or (param.ndim == 2 and not adamw_2d) else "adamw"
    norm = tp_dim is None and param.ndim == 1 and _is_norm(name, owner)
    partial = partial or (context.sequence_parallel and norm)
    return ParamDescription(
        name,
        shape,
        _dtype_name(name, param),
        tp_dim,
        optimizer,
        fused,
        grouped,
        PARTIAL_OVER_TP if partial else None,
        qkv,
    ), tp_size


def _spmd_axis(model: nn.Module, tp_mesh_dim: str) -> Any:
    """The TP axis of a model parallelized under spmd_types (None: not such a model)."""
    try:
        return titan.spmd_tp_axis(model, tp_mesh_dim)
    except titan.TitanLayoutError as error:
        raise DescribeError(str(error)) from None


def _spmd_placement(name: str, param: torch.Tensor, axis: Any) -> tuple[int | None, int | None, bool, tuple[int, ...]]:
    """(TP dim, TP size, partial gradient, global shape) of a parameter under spmd_types."""
    try:
        placement = titan.spmd_placement(param, axis)
    except titan.TitanLayoutError as error:
        raise DescribeError(f"parameter {name!r}: {error}") from None
    if placement is None:
        return None, None, False, tuple(param.shape)
    shape = list(param.shape)
    if placement.tp_dim is not None:
        shape[placement.tp_dim] *= placement.tp_size
    return placement.tp_dim, placement.tp_size, placement.partial, tuple(shape)


def _fused_qkv(name: str, shape: tuple[int, ...], owner: nn.Module, context: _Context) -> tuple[int, int, int] | None:
    """A fused QKV weight's (query groups, heads, head dim): Megatron-core's `linear_qkv` or
    torchtitan's `wqkv`, checked against its rows."""
    if len(shape) != 2:
        return None
    if context.megatron_tp is not None:
        layout = megatron.qkv_layout(name, owner, megatron.model_config(context.model))
    else:
        layout = titan.fused_qkv_layout(name, shape[0], context.model)
    if layout is None:
        return None
    groups, heads, head_dim = layout["query_groups"], layout["heads"], layout["head_dim"]
    if shape[0] != (heads + 2 * groups) * head_dim:
        raise DescribeError(
            f"parameter {name!r} has {shape[0]} rows, but its {heads} heads in {groups} query groups "
            f"of {head_dim} make {(heads + 2 * groups) * head_dim}: not a fused QKV layout canzona knows"
        )
    return groups, heads, head_dim


def _megatron_tp_size(model: nn.Module) -> int | None:
    """The TP size of a Megatron-core model (its parameters carry Megatron's TP attributes), else None."""
    if not megatron.is_megatron(model):
        return None
    try:
        return megatron.tp_size(model)
    except megatron.MegatronConfigError as error:
        raise DescribeError(str(error)) from None


def _megatron_placement(param: torch.Tensor, size: int) -> tuple[int | None, int | None, tuple[int, ...]]:
    """(TP dim, strided split factor, global shape) of a Megatron parameter shard."""
    layout = megatron.tp_layout(param)
    if layout is None:
        return None, None, tuple(param.shape)
    return layout.dim, layout.stride if layout.stride > 1 else None, megatron.global_shape(param, layout, size)


def _class_name(model: nn.Module) -> str:
    """The model's class name (FSDP2's `fully_shard` renames the class `FSDP<name>`)."""
    name = type(model).__name__
    bases = {cls.__name__ for cls in type(model).__mro__[1:]}
    return name[len("FSDP") :] if name.startswith("FSDP") and name[len("FSDP") :] in bases else name


def _owning_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Parameter id -> the module that registers it (the first one, for shared parameters)."""
    owners: dict[int, nn.Module] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), module)
    return owners


def _output_heads(model: nn.Module) -> list[nn.Module]:
    heads = [module for child, module in model.named_children() if child in OUTPUT_HEADS]
    getter = getattr(model, "get_output_embeddings", None)
    if callable(getter):
        try:
            head = getter()
        except Exception:
            head = None
        if isinstance(head, nn.Module):
            heads.append(head)
    return heads


def _adamw_2d(name: str, owner: nn.Module, heads: list[nn.Module]) -> bool:
    lowered = name.lower()
    return (
        isinstance(owner, nn.Embedding)
        or any(owner is head for head in heads)
        or any(h in lowered for h in ADAMW_NAME_HINTS)
    )


def _is_norm(name: str, owner: nn.Module) -> bool:
    return "norm" in type(owner).__name__.lower() or "norm" in name.lower()


def _dtype_name(name: str, param: torch.Tensor) -> str:
    if param.dtype not in DTYPE_NAMES:
        raise DescribeError(f"parameter {name!r} is {param.dtype}; canzona plans fp32, bf16 and fp16 parameters")
    return DTYPE_NAMES[param.dtype]


def _tp_placement(name: str, param: torch.Tensor, mesh_dim: str) -> tuple[int | None, int | None, int | None, bool]:
    """(TP dim, strided split factor, TP mesh size, gradient partial over TP) of a parameter."""
    if not isinstance(param, DTensor):
        return None, None, None, False
    mesh = param.device_mesh
    dims = mesh.mesh_dim_names or ()
    if mesh_dim not in dims:
        return None, None, None, False
    axis = dims.index(mesh_dim)
    placement = param.placements[axis]
    grad = param.grad
    partial = isinstance(grad, DTensor) and isinstance(grad.placements[axis], Partial)
    if isinstance(placement, Replicate):
        return None, None, mesh.size(axis), partial
    # A strided shard (transformers' packed gate/up) is no Shard subclass: it has a dim and a split factor.
    split = getattr(placement, "split_factor", None)
    if isinstance(placement, Shard) or (split is not None and hasattr(placement, "dim")):
        return placement.dim % param.ndim, split if split and split > 1 else None, mesh.size(axis), False
    raise DescribeError(
        f"parameter {name!r} has placement {placement} on mesh dim {mesh_dim!r}; parameters are "
        "Shard or Replicate there"
    )


def _with_partial_patterns(params: list[ParamDescription], patterns: list[str]) -> list[ParamDescription]:
    """Mark the parameters matching any pattern as partial over TP (each pattern must match)."""
    out = list(params)
    for pattern in patterns:
        hits = [i for i, p in enumerate(out) if fnmatch.fnmatchcase(p.name, pattern)]
        if not hits:
            raise DescribeError(f"partial-gradient pattern {pattern!r} matches no parameter")
        for i in hits:
            if out[i].tp_dim is not None:
                raise DescribeError(
                    f"parameter {out[i].name!r} is split over TP (dim {out[i].tp_dim}); only "
                    "replicated parameters have partial gradients"
                )
            out[i] = ParamDescription(**{**vars(out[i]), "grad_reduce": PARTIAL_OVER_TP})
    return out


# ---------------------------------------------------------------------------------------------
# Factories: `py:MODULE:FACTORY`


def load_factory(source: str) -> Callable[[], Any]:
    """The factory named by `py:package.module:function` (imported with the working directory on
    the path) or `py:path/to/file.py:function`. DescribeError when it cannot be found."""
    body = source.removeprefix(PY_PREFIX)
    module_name, _, attribute = body.rpartition(":")
    if not source.startswith(PY_PREFIX) or not module_name or not attribute:
        raise DescribeError(
            f"a live model is py:MODULE:FACTORY (e.g. py:mypkg.models:make_model or "
            f"py:models.py:make_model), got {source!r}"
        )
    try:
        module = _import(module_name)
    except DescribeError:
        raise
    except (Exception, SystemExit) as error:
        raise DescribeError(f"importing {module_name!r} raised {type(error).__name__}: {_first_line(error)}") from error
    factory = getattr(module, attribute, None)
    if factory is None:
        raise DescribeError(f"{module_name!r} has no {attribute!r}")
    if not callable(factory):
        raise DescribeError(f"{module_name}:{attribute} is of type {type(factory).__name__}, not a function")
    return factory


def _import(module_name: str) -> Any:
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise DescribeError(f"no such model file {module_name!r}")
        spec = importlib.util.spec_from_file_location(f"canzona_model_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses and pickling look their module up there
        sys.path.insert(0, str(path.resolve().parent))  # the file's own imports of its neighbours
        try:
            spec.loader.exec_module(module)
        finally:
            sys.path.remove(str(path.resolve().parent))
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        raise DescribeError(f"cannot import {module_name!r}: {error}") from error


def build_on_meta(factory: Callable[[], Any], label: str) -> nn.Module:
    """Call `factory()` under `torch.device("meta")`: parameters get shapes, no memory."""
    try:
        with torch.device("meta"):
            model = factory()
    except (Exception, SystemExit) as error:
        raise DescribeError(f"model factory {label} raised {type(error).__name__}: {_first_line(error)}") from error
    if not isinstance(model, nn.Module):
        raise DescribeError(
            f"model factory {label} returned a value of type {type(model).__name__}, not a torch.nn.Module"
        )
    return model


def describe_factory(source: str, *, sequence_parallel: bool = False) -> ModuleDescription:
    """Describe the model `py:MODULE:FACTORY` builds on the meta device, named after the factory."""
    factory = load_factory(source)
    model = build_on_meta(factory, source)
    return describe_module(model, name=source.rpartition(":")[2], sequence_parallel=sequence_parallel)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "(no message)"
