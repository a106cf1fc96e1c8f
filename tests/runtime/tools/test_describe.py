"""Describing a live nn.Module: names and order, global shapes, dtypes, TP dims from DTensor
placements (TP, FSDP2 and both), grouped 3-D experts, partial gradients; and agreement with
the planner's naming conventions for the same model. DeviceMeshes without a cluster use
torch's fake process group, in a forked child so no process group outlives the test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from canzona.planner.compile import compile_schedule
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.architecture import Architecture
from canzona.planner.sources.catalog import enumerate_params
from canzona.planner.sources.conventions import mark_partial_norms
from canzona.planner.sources.load import load_model, model_from_data
from canzona.planner.spec import ModelOptions, ModelSpec
from canzona.runtime.schedule import check_schedule
from canzona.runtime.tools.describe import (
    DescribeError,
    ModuleDescription,
    build_on_meta,
    describe_factory,
    describe_module,
    load_factory,
)

from rt_harness import fake_world, in_child, run_ranks
from titan_model import TitanConfig, TitanModel, parallelize_titan

HF_QWEN3_MOE = dict(
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
    mlp_only_layers=[0],
)
TITAN_ARCH = Architecture(
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


def rows(spec: ModelSpec) -> list[tuple[Any, ...]]:
    """Everything the planner reads of a model's parameters."""
    return [
        (
            p.name,
            p.shape,
            p.dtype,
            p.tp_dim,
            p.optimizer,
            p.submatrices,
            p.row_blocks,
            p.parent,
            p.expert_index,
            p.num_experts,
            p.grad_reduce,
        )
        for p in spec.params
    ]


def planned(description: ModuleDescription, tp: int, **options: Any) -> ModelSpec:
    return model_from_data(
        description.to_data(), description.name, "py:test:model", description.sha256, tp, ModelOptions(**options)
    )


def hf_config() -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoConfig.for_model("qwen3_moe", **HF_QWEN3_MOE)


def hf_model(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(hf_config(), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Plain modules


def test_hf_model_is_described_as_the_hf_convention_plans_it(tmp_path: Path) -> None:
    description = describe_module(hf_model())
    assert description.name == "Qwen3MoeForCausalLM" and description.tp is None
    entries = {p.name: p for p in description.params}
    assert entries["model.layers.1.mlp.experts.gate_up_proj"].grouped_experts
    assert entries["model.layers.1.mlp.experts.gate_up_proj"].shape == (4, 64, 64)
    assert (entries["model.embed_tokens.weight"].optimizer, entries["lm_head.weight"].optimizer) == ("adamw", "adamw")
    assert entries["model.layers.1.mlp.gate.weight"].optimizer == "matrix"
    assert {p.dtype for p in description.params} == {"bf16"}
    config = tmp_path / "config.json"
    config.write_text(hf_config().to_json_string())
    from_config = load_model(str(config), 1, ModelOptions(names="hf"))
    # A plain model is replicated over TP: the same parameters as the convention's, without TP dims.
    assert rows(planned(description, 1)) == [(*r[:3], None, *r[4:]) for r in rows(from_config)]
    schedule = compile_schedule(make_plan(planned(description, 1), PlanRequest("py:test:model", 1, 2)))
    assert schedule.fingerprint == description.fingerprint


def test_dtype_is_always_recorded() -> None:
    assert {p.dtype for p in describe_module(hf_model(torch.float32)).params} == {"fp32"}
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.float16))
    assert [p.dtype for p in describe_module(mixed).params] == ["fp32", "fp32", "fp16", "fp16"]


def test_classification_of_plain_parameters() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.proj = nn.Linear(4, 4)
            self.norm = nn.LayerNorm(4)
            self.conv = nn.Conv1d(4, 4, 3)
            self.output = nn.Linear(4, 10, bias=False)

    described = {p.name: p.optimizer for p in describe_module(Net()).params}
    assert described == {
        "embed.weight": "adamw",
        "proj.weight": "matrix",
        "proj.bias": "adamw",
        "norm.weight": "adamw",
        "norm.bias": "adamw",
        "conv.weight": "adamw",
        "conv.bias": "adamw",
        "output.weight": "adamw",
    }


def test_sequence_parallel_and_partial_patterns_mark_replicated_parameters() -> None:
    model = hf_model()
    sp = {p.name for p in describe_module(model, sequence_parallel=True).params if p.grad_reduce}
    assert sp == {p.name for p in describe_module(model).params if "norm" in p.name}
    qk = describe_module(model, partial_grads=["*.q_norm.weight", "*.k_norm.weight"])
    assert {p.name for p in qk.params if p.grad_reduce} == {
        f"model.layers.{n}.self_attn.{w}_norm.weight" for n in (0, 1) for w in "qk"
    }
    with pytest.raises(DescribeError, match="'\\*.qnorm' matches no parameter"):
        describe_module(model, partial_grads=["*.qnorm"])


def test_description_yaml_is_a_parameter_list_the_planner_reads(tmp_path: Path) -> None:
    description = describe_module(hf_model(), sequence_parallel=True)
    path = tmp_path / "params.yaml"
    path.write_text(description.to_yaml())
    assert description.to_yaml() == describe_module(hf_model(), sequence_parallel=True).to_yaml()  # deterministic
    from_file = load_model(str(path), 2)
    assert rows(from_file) == rows(planned(description, 2))
    assert any(p.grad_reduce == "tp" for p in from_file.params)


@pytest.mark.parametrize(
    "model, needle",
    [
        (nn.Linear(2, 2).double(), "is torch.float64; canzona plans fp32, bf16 and fp16"),
        (nn.ReLU(), "has no parameters"),
    ],
)
def test_models_that_cannot_be_described(model: nn.Module, needle: str) -> None:
    with pytest.raises(DescribeError, match=needle):
        describe_module(model)


def test_factories(tmp_path: Path) -> None:
    module = tmp_path / "factories.py"
    module.write_text(
        "import torch\n"
        "def tiny():\n    return torch.nn.Linear(3, 5)\n"
        "def where():\n    return torch.nn.Linear(3, 5).weight.device.type\n"
        "def fails():\n    raise RuntimeError('needs a GPU\\nmore detail')\n"
        "NOT_A_FUNCTION = 3\n"
    )
    described = describe_factory(f"py:{module}:tiny")
    assert described.name == "tiny" and [p.shape for p in described.params] == [(5, 3), (5,)]
    with pytest.raises(DescribeError, match="returned a value of type str, not a torch.nn.Module"):
        build_on_meta(load_factory(f"py:{module}:where"), "where")  # built on meta: 'meta'
    for source, needle in [
        (f"py:{module}:fails", f"model factory py:{module}:fails raised RuntimeError: needs a GPU$"),
        (f"py:{module}:missing", "has no 'missing'"),
        (f"py:{module}:NOT_A_FUNCTION", "is of type int, not a function"),
        ("py:no_such_module_anywhere:make", "cannot import 'no_such_module_anywhere'"),
        (f"py:{tmp_path / 'absent.py'}:make", "no such model file"),
        ("py:make_model", "a live model is py:MODULE:FACTORY"),
    ]:
        with pytest.raises(DescribeError, match=needle) as excinfo:
            describe_factory(source)
        assert "\n" not in str(excinfo.value)


def test_a_large_model_costs_no_memory() -> None:
    """Qwen3-30B-A3B's real widths (4 of its 48 layers: 2.4 B parameters) on the meta device."""
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "qwen3_moe",
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_experts=128,
        num_experts_per_tok=8,
        num_hidden_layers=4,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        vocab_size=151936,
    )
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert all(p.device.type == "meta" for p in model.parameters())
    description = describe_module(model)
    assert sum(torch.Size(p.shape).numel() for p in description.params) > 2_000_000_000
    spec = planned(description, 1)
    assert sum(1 for p in spec.params if p.parent is not None) == 4 * 2 * 128


# ---------------------------------------------------------------------------------------------
# DTensor placements (fake process group, forked child)


def _hf_tp_fsdp() -> list[Any]:
    import transformers
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    mesh = fake_world(4, (2, 2), ("dp", "tp"))
    config = transformers.AutoConfig.for_model("qwen3_moe", **HF_QWEN3_MOE)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(),
    }
    for n in (0, 1):
        plan.update({f"model.layers.{n}.self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")})
        plan[f"model.layers.{n}.self_attn.o_proj"] = RowwiseParallel()
    plan.update(
        {
            "model.layers.0.mlp.gate_proj": ColwiseParallel(),
            "model.layers.0.mlp.up_proj": ColwiseParallel(),
            "model.layers.0.mlp.down_proj": RowwiseParallel(),
        }
    )
    parallelize_module(model, mesh["tp"], plan)
    # transformers' own styles for the grouped experts: packed colwise (a strided shard) and rowwise.
    apply_tensor_parallelism(
        model,
        mesh["tp"],
        {
            "model.layers.1.mlp.experts.gate_up_proj": "packed_colwise",
            "model.layers.1.mlp.experts.down_proj": "rowwise",
        },
    )
    fully_shard(model, mesh=mesh["dp"])
    return [describe_module(model)]


@pytest.mark.slow
def test_hf_model_under_tp_and_fsdp2_reads_its_placements(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    (description,) = in_child(_hf_tp_fsdp)
    assert description.tp == 2 and description.name == "Qwen3MoeForCausalLM"
    fused = {p.name: p.fused for p in description.params if p.fused}
    assert fused == {"model.layers.1.mlp.experts.gate_up_proj": 2}  # each TP shard holds [gate shard; up shard]
    config = tmp_path / "config.json"
    config.write_text(hf_config().to_json_string())
    from_config = load_model(str(config), 2, ModelOptions(names="hf"))
    assert rows(planned(description, 2)) == rows(from_config)
    schedule = compile_schedule(make_plan(from_config, PlanRequest(str(config), 2, 2, bucket_size=2000)))
    assert schedule.fingerprint == description.fingerprint  # the runtime can compare a live model with a schedule
    with pytest.raises(Exception, match="read from a model at TP 2"):
        planned(description, 4)


def _titan_tp_fsdp() -> list[Any]:
    from torch.distributed.fsdp import fully_shard

    mesh = fake_world(4, (2, 2), ("dp", "tp"))
    with torch.device("meta"):
        model = TitanModel(TitanConfig())
    parallelize_titan(model, mesh["tp"])
    for block in model.layers.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    try:
        describe_module(model, partial_grads=["layers.0.attention.qkv_linear.wqkv.weight"])
        sharded_error = ""
    except DescribeError as error:
        sharded_error = str(error)
    return [describe_module(model), describe_module(model, sequence_parallel=True), sharded_error]


@pytest.mark.slow
def test_torchtitan_model_under_tp_and_fsdp2_is_the_torchtitan_convention() -> None:
    plain, sequence_parallel, sharded_error = in_child(_titan_tp_fsdp)
    assert plain.name == "TitanModel" and plain.tp == 2
    convention = enumerate_params("titan", TITAN_ARCH, 2, ModelOptions(names="torchtitan"))
    # FSDP2 completes the norms' gradients over TP: the convention marks none, as the plain description
    assert rows(planned(plain, 2, names="megatron")) == [tuple(replace_dtype(p)) for p in convention]
    flagged = mark_partial_norms(list(convention))  # what --sequence-parallel adds
    assert rows(planned(sequence_parallel, 2, names="megatron")) == [tuple(replace_dtype(p)) for p in flagged]
    assert {p.name for p in flagged if p.grad_reduce} == {p.name for p in convention if "norm" in p.name}
    assert "split over TP (dim 0)" in sharded_error


def replace_dtype(param: Any) -> tuple[Any, ...]:
    """The convention's row with the live model's dtype (fp32; the catalog assumes bf16)."""
    return (
        param.name,
        param.shape,
        "fp32",
        param.tp_dim,
        param.optimizer,
        param.submatrices,
        param.row_blocks,
        param.parent,
        param.expert_index,
        param.num_experts,
        param.grad_reduce,
    )


# ---------------------------------------------------------------------------------------------
# Partial gradients read from a probe (two gloo ranks)


class _SequenceParallelBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.norm = nn.RMSNorm(8)
        self.up = nn.Linear(8, 16, bias=False)
        self.down = nn.Linear(16, 8, bias=False)
        self.head_norm = nn.RMSNorm(8)  # replicated, but never sequence-sharded: its gradient is whole

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head_norm(self.down(self.up(self.norm(self.embed(ids)))))


def _probe_rank(rank: int, world: int) -> list[Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = _SequenceParallelBlock()
    parallelize_module(
        model,
        mesh,
        {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "up": ColwiseParallel(input_layouts=Shard(1)),
            "down": RowwiseParallel(),
        },
    )
    model.head_norm.weight = nn.Parameter(
        torch.distributed.tensor.distribute_tensor(model.head_norm.weight, mesh, [Replicate()])
    )
    model.head_norm.register_forward_pre_hook(
        lambda module, args: tuple(torch.distributed.tensor.DTensor.from_local(a, mesh, [Replicate()]) for a in args)
    )

    def probe(m: nn.Module) -> None:
        out = m(torch.randint(0, 32, (2, 4)))
        (out.to_local() if hasattr(out, "to_local") else out).sum().backward()

    description = describe_module(model, probe=probe)
    return [description, [p.grad is None for p in model.parameters()]]


@pytest.mark.slow
def test_probe_marks_the_parameters_whose_gradients_are_partial() -> None:
    results = run_ranks(_probe_rank, 2)
    description, cleared = results[0]
    assert {p.name for p in description.params if p.grad_reduce} == {"norm.weight"}
    assert [p.tp_dim for p in description.params] == [0, None, 0, 1, None]
    assert all(cleared)
    assert results[1][0] == description


# ---------------------------------------------------------------------------------------------
# The runtime executes what the description records (tests/runtime/test_runtime_models.py runs it)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_runtime_accepts_grouped_experts_and_partial_gradients(sequence_parallel: bool) -> None:
    description = describe_module(nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)), sequence_parallel=True)
    if not sequence_parallel:
        description = describe_module(hf_model())
    spec = planned(description, 2)
    schedule = compile_schedule(make_plan(spec, PlanRequest("py:test:model", 2, 2, bucket_size=2000)))
    assert any(e.param is not None for e in schedule.params) or any(e.grad_reduce for e in schedule.params)
    check_schedule(schedule, "plan.yaml")


def test_describe_does_not_import_the_planner() -> None:
    import subprocess
    import sys

    probe = (
        "import sys, torch; from canzona.runtime.tools.describe import describe_module; "
        "describe_module(torch.nn.Linear(2, 2)); "
        "assert not any(m.startswith('canzona.planner') or m.startswith('canzona.cli') for m in sys.modules)"
    )
    subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True)
