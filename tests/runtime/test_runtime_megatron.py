"""megatron-core, the real package: a live `GPTModel` (examples/megatron_gpt.py, Megatron's local
layer spec, its ColumnParallelLinear / RowParallelLinear at TP 2) planned by `canzona plan --model
py:...`, trained with `CanzonaOptimizer` configured from Megatron's own `OptimizerConfig`
(`canzona.runtime.integrations.megatron`), and compared step by step with Megatron's Muon on the
same gradients (`megatron_oracle.py`: the formula always, megatron-core's `TensorParallelMuon`
where it imports).

Error: max over parameters of max |canzona - reference| / max |reference - initial| after 3
steps, fp32 (Newton-Schulz at Megatron's "highest" matmul precision). Measured
(benchmarks/megatron_parity.py, BENCHMARKS.md): 1.7e-6 to 5.1e-6 against the fp32 formula and
against megatron-core's own Muon; the fp32 formula itself is 1.0e-5 to 1.1e-5 from the same step
in fp64, so two fp32 implementations can differ by about 2e-5 by rounding alone, and the bound is
the issue's 1e-4. The mismatches the mapping exists for (QKV whole, the simple coefficients,
Nesterov, canzona's own 0.2 scale) are 0.2 to 0.8 away."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from rt_harness import canzona_in_child, run_ranks

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from megatron_oracle import example, megatron_muon_available, run_parity

BOUND = 1e-4  # the issue's; measured 1.7e-6 to 5.1e-6, fp32 rounding alone about 2e-5 (module docstring)


@pytest.mark.slow
@pytest.mark.parametrize("tp, dp", [(1, 1), (1, 2), (2, 1), (2, 2)], ids=["tp1-dp1", "tp1-dp2", "tp2-dp1", "tp2-dp2"])
def test_megatrons_default_muon_is_reproduced(tp: int, dp: int, tmp_path: Path) -> None:
    """Megatron's defaults (split QKV per query group, quintic coefficients, no Nesterov, spectral
    scale √max(m, n)), planned with the options `plan_options` names, at each layout."""
    error, where = run_parity(tmp_path, tp, dp, ("--ns-coefficients", "quintic"))
    assert error < BOUND, f"{where}: {error:.3g}"


@pytest.mark.slow
def test_a_plan_with_canzonas_defaults_splits_qkv_as_megatron(tmp_path: Path) -> None:
    """The plan canzona makes by default (no option) splits the live model's QKV per query group;
    with the simple coefficients on Megatron's side too, the runs agree; Nesterov and weight
    decay as Megatron spells them."""
    error, where = run_parity(
        tmp_path, 2, 2, overrides={"muon_use_nesterov": True, "weight_decay": 0.1, "muon_coefficient_type": "simple"}
    )
    assert error < BOUND, f"{where}: {error:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp, flags, ours, theirs",
    [
        (
            1,
            ("--ns-coefficients", "quintic", "--split-qkv", "none"),
            {"muon_split_qkv": False},
            {"muon_split_qkv": True},
        ),
        (1, (), {"muon_coefficient_type": "simple"}, {"muon_coefficient_type": "quintic"}),
        (2, ("--ns-coefficients", "quintic"), {}, {"muon_tp_mode": "blockwise"}),
    ],
    ids=["qkv-whole", "simple-coefficients", "blockwise"],
)
def test_the_reference_tells_the_mismatches_apart(
    tp: int, flags: tuple[str, ...], ours: dict[str, Any], theirs: dict[str, Any], tmp_path: Path
) -> None:
    """Negative controls: QKV kept whole, or the simple coefficients, against Megatron's default
    is far outside the bound; so is Megatron's blockwise TP mode at TP 2 against the
    whole-matrix update (why `optimizer_kwargs` refuses it there)."""
    error, _ = run_parity(tmp_path, tp, 1, flags, overrides=ours, reference_overrides=theirs)
    assert error > 100 * BOUND


@pytest.mark.slow
@pytest.mark.skipif(
    not megatron_muon_available(),
    reason="megatron-core's Muon needs emerging_optimizers, which is not on the package index",
)
@pytest.mark.parametrize("tp, dp", [(1, 2), (2, 1)])
def test_megatron_cores_own_muon_is_reproduced(tp: int, dp: int, tmp_path: Path) -> None:
    error, where = run_parity(tmp_path, tp, dp, ("--ns-coefficients", "quintic"), backend="megatron")
    assert error < BOUND, f"{where}: {error:.3g}"
    assert math.isfinite(error)


# ---------------------------------------------------------------------------------------------
# Megatron's local spec under canzona's names, and what a live description reads


def _described(rank: int, world: int, moe: bool) -> Any:
    """The description of the example's model (or a MoE variant) at TP `world`, on rank 0."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from canzona.runtime.tools.describe import describe_module

    gpt = example()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, distributed_timeout_minutes=1)
    with torch.device("meta"):
        if moe:
            config = gpt.transformer_config(
                world,
                num_moe_experts=4,
                moe_ffn_hidden_size=32,
                moe_router_topk=2,
                moe_shared_expert_intermediate_size=32,
            )
            spec = get_gpt_layer_local_spec(
                num_experts=4, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
            )
            model = GPTModel(
                config=config,
                transformer_layer_spec=spec,
                vocab_size=gpt.VOCAB,
                max_sequence_length=gpt.SEQ,
                position_embedding_type="rope",
                share_embeddings_and_output_weights=False,
            )
        else:
            model = gpt.build(world)
    return describe_module(model).to_data() if rank == 0 else None


@pytest.mark.parametrize("tp, moe", [(1, False), (2, False), (1, True)], ids=["dense-tp1", "dense-tp2", "moe-tp1"])
@pytest.mark.parametrize("split_qkv", ["qkv", "head"])
def test_megatron_local_names_are_what_the_local_spec_registers(tp: int, moe: bool, split_qkv: str) -> None:
    """`--names megatron-local` of the equivalent architecture lists the live local-spec model's
    parameters: names, order, full shapes, TP dims, submatrices and row blocks."""
    from canzona.planner.sources.architecture import Architecture
    from canzona.planner.sources.catalog import enumerate_params
    from canzona.planner.sources.load import model_from_data
    from canzona.planner.spec import ModelOptions

    data = run_ranks(_described, tp, moe, timeout=120)[0]
    options = ModelOptions(names="megatron-local", split_qkv=split_qkv)
    live = model_from_data(data, "m", "py:m:f", "0" * 64, tp, ModelOptions(split_qkv=split_qkv)).params
    moe_fields: dict[str, Any] = (
        dict(num_experts=4, top_k=2, expert_ffn=32, num_shared_experts=1, shared_expert_ffn=32, family="qwen3_moe")
        if moe
        else {"family": "qwen3"}
    )
    arch = Architecture(64, 160, 2, 4, 2, 16, 256, qk_norm=True, **moe_fields)
    catalog = enumerate_params("m", arch, tp, options)

    def key(p: Any) -> tuple[Any, ...]:
        return p.name, p.shape, p.tp_dim, p.optimizer, p.submatrices, p.row_blocks

    assert [key(p) for p in catalog] == [key(p) for p in live]


def test_a_live_megatron_plan_records_megatrons_layout() -> None:
    """Planned at TP 2: QKV in Q, K, V blocks per query group, fc1 as [gate; up] from its
    shards, full shapes, the embedding and output layer AdamW's, the TP size recorded."""
    data = run_ranks(_described, 2, False, timeout=120)[0]
    entries = {entry["name"]: entry for entry in data["params"]}
    assert data["tp"] == 2
    assert entries["decoder.layers.0.self_attention.linear_qkv.weight"]["qkv"] == {
        "query_groups": 2,
        "heads": 4,
        "head_dim": 16,
    }
    assert entries["decoder.layers.0.mlp.linear_fc1.weight"] == {
        "name": "decoder.layers.0.mlp.linear_fc1.weight",
        "shape": [320, 64],
        "tp_dim": 0,
        "dtype": "fp32",
        "optimizer": "matrix",
        "fused": 2,
    }
    assert entries["decoder.layers.0.self_attention.linear_proj.weight"]["tp_dim"] == 1
    assert {n for n, e in entries.items() if e["optimizer"] == "adamw" and len(e["shape"]) == 2} == {
        "embedding.word_embeddings.weight",
        "output_layer.weight",
    }


def _gradients(rank: int, world: int, finalize: bool) -> Any:
    """The example model's full gradients (TP shards gathered) for one batch at TP `world`,
    after `finalize_model_grads` (or without it), on rank 0."""
    from megatron.core import parallel_state

    from canzona.runtime.integrations import megatron as cz_megatron

    from megatron_oracle import _gathered

    gpt = example()
    gpt.run_megatron_on_cpu()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world, distributed_timeout_minutes=1)
    torch.manual_seed(0)
    model = gpt.build(world)
    tokens, labels = gpt.batch(0, 0, torch.device("cpu"))
    causal = torch.ones(gpt.SEQ, gpt.SEQ, dtype=torch.bool).triu(1)[None, None]
    positions = torch.arange(gpt.SEQ).unsqueeze(0).expand(2, -1)
    model(tokens, positions, causal, labels=labels).mean().backward()
    if finalize:
        cz_megatron.finalize_model_grads([model])
    grads = _gathered(model, parallel_state.get_tensor_model_parallel_group(), grads=True)
    return grads if rank == 0 else None


def test_finalize_model_grads_gives_tp2_the_gradients_of_tp1() -> None:
    """Megatron's TP-side sums without its DP reduction: at TP 2 the qk-layernorm gradients are
    partial sums until `finalize_model_grads`, after which every gradient is the TP 1 model's
    (to fp32 summation order: 1e-6 of its largest element)."""
    whole = run_ranks(_gradients, 1, True, timeout=120)[0]
    split, partial = run_ranks(_gradients, 2, True, timeout=120)[0], run_ranks(_gradients, 2, False, timeout=120)[0]
    for name, grad in whole.items():
        ours = split[name]
        if name.endswith("linear_fc1.weight"):  # gathered [gate 0; up 0; gate 1; up 1] -> [gate; up]
            ours = ours.view(2, 2, -1, ours.size(1)).transpose(0, 1).reshape_as(ours)
        torch.testing.assert_close(ours, grad, rtol=0, atol=1e-6 * float(grad.abs().max()), msg=name)
    norms = [name for name in whole if "q_layernorm" in name or "k_layernorm" in name]
    assert norms and all(not torch.allclose(partial[name], whole[name], atol=1e-6) for name in norms)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_example_recipe_trains(tmp_path: Path) -> None:
    """examples/megatron_gpt.py as docs/megatron.md and examples/README.md run it: plan the live
    model at TP 2 x DP 2, then `torchrun --nproc-per-node 4` (gloo here); the loss falls."""
    import os
    import re
    import subprocess
    import sys

    from megatron_oracle import EXAMPLE

    path = tmp_path / "mcore.yaml"
    canzona_in_child(
        [
            "plan",
            "--model",
            f"py:{EXAMPLE}:make_model_tp2",
            "--tp",
            "2",
            "--dp",
            "2",
            "--ns-coefficients",
            "quintic",
            "--bucket-size",
            "20000",
            "--group-mb",
            "0.05",
            "-o",
            str(path),
        ]
    )
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        "4",
        str(EXAMPLE),
        "--schedule",
        str(path),
        "--steps",
        "12",
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=200, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = re.search(r"loss ([\d.]+) -> ([\d.]+)", result.stdout)
    assert summary and float(summary.group(2)) < 0.9 * float(summary.group(1)), result.stdout


# ---------------------------------------------------------------------------------------------
# On a GPU: Megatron's DistributedDataParallel (main_grad), and Transformer Engine's layer spec


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_parity(schedule: Any, results: Any) -> None:
    """One NCCL rank on GPU 0: docs/megatron.md's recipe (Megatron's DDP, main_grad) against
    Megatron's Muon on the same main_grad; the result on `results`."""
    import os
    import tempfile

    import torch.distributed as dist

    from megatron_oracle import train_against_oracle

    torch.cuda.set_device(0)
    with tempfile.TemporaryDirectory() as folder:
        dist.init_process_group(
            "nccl",
            init_method=f"file://{os.path.join(folder, 'store')}",
            rank=0,
            world_size=1,
            device_id=torch.device("cuda", 0),
        )
        try:
            results.put(train_against_oracle(schedule, {}, ("formula",), {}, torch.device("cuda", 0)))
        finally:
            dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.timeout(300)
@needs_cuda
def test_megatrons_ddp_and_main_grad_on_cuda(tmp_path: Path) -> None:
    """The recipe as written, on CUDA: Megatron's DistributedDataParallel with fp32 main_grad,
    canzona reading main_grad, Megatron's default Muon (fp32 Newton-Schulz for the comparison)."""
    import multiprocessing

    from megatron_oracle import parity_error, plan

    schedule = plan(tmp_path, 1, 1, "--ns-coefficients", "quintic")
    context = multiprocessing.get_context("spawn")  # CUDA in a fresh process
    results = context.Queue()
    child = context.Process(target=_gpu_parity, args=(schedule, results))
    child.start()
    result = results.get(timeout=240)
    child.join(timeout=60)
    error, where = parity_error(result["canzona"], result["references"]["formula"], result["initial"])
    assert error < BOUND, f"{where}: {error:.3g}"


@pytest.mark.gpu
@pytest.mark.timeout(300)
@needs_cuda
@pytest.mark.parametrize("spec", ["local", "te"])
def test_both_layer_specs_plan_and_train_on_cuda(spec: str, tmp_path: Path) -> None:
    """Transformer Engine's spec (its `linear_qkv.layer_norm_weight`, ...) and the local spec each
    plan from the live model and train with no renaming: the example under torchrun on one GPU."""
    import os
    import subprocess
    import sys

    if spec == "te":
        pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed")
    from megatron_oracle import EXAMPLE

    path = tmp_path / f"{spec}.yaml"
    factory = "make_model" if spec == "local" else "make_model_te"
    canzona_in_child(["plan", "--model", f"py:{EXAMPLE}:{factory}", "--ns-coefficients", "quintic", "-o", str(path)])
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [
        str(torchrun),
        "--standalone",
        "--nproc-per-node",
        "1",
        str(EXAMPLE),
        "--schedule",
        str(path),
        "--steps",
        "12",
        "--spec",
        spec,
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stdout + result.stderr
    import re

    summary = re.search(r"loss ([\d.]+) -> ([\d.]+)", result.stdout)
    assert summary and float(summary.group(2)) < 0.9 * float(summary.group(1)), result.stdout
