"""`canzona.runtime.integrations.megatron` on its own: Megatron's `OptimizerConfig` mapped onto
canzona's hyperparameters and groups, the settings it cannot reproduce refused in one line, the
attributes read from Megatron's parameters, and `finalize_model_grads`' token scaling. The end to
end comparison with Megatron's Muon is tests/runtime/test_runtime_megatron.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from canzona.runtime.integrations import megatron
from canzona.schedules.format import Schedule

from rt_harness import make_schedule, run_ranks

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "examples" / "tiny_qwen3.yaml"
optimizer_config = pytest.importorskip(
    "megatron.core.optimizer", reason="megatron-core is not installed"
).OptimizerConfig


@pytest.fixture(scope="module")
def schedules() -> dict[tuple[int, str], Schedule]:
    return {
        (tp, name): make_schedule(TINY, tp, 2, ns_coefficients=name) for tp in (1, 2) for name in ("quintic", "simple")
    }


def test_megatrons_defaults_become_canzonas_settings(schedules: dict[tuple[int, str], Schedule]) -> None:
    config = optimizer_config(optimizer="muon", lr=0.01, weight_decay=0.1)
    assert megatron.plan_options(config) == {"ns_steps": 5, "ns_coefficients": "quintic", "split_qkv": "qkv"}
    assert megatron.optimizer_kwargs(config, schedules[1, "quintic"]) == {
        "lr": 0.01,
        "weight_decay": 0.1,
        "momentum": 0.95,
        "nesterov": False,
        "ns_dtype": "bf16",
        "update_scale": "spectral",
        "update_scale_factor": 1.0,
        "adamw_lr": 0.01,
        "adamw_weight_decay": 0.1,
        "adamw_betas": (0.9, 0.999),
        "adamw_eps": 1e-8,
    }


def test_every_mapped_option_follows_the_config(schedules: dict[tuple[int, str], Schedule]) -> None:
    config = optimizer_config(
        optimizer="muon",
        lr=0.02,
        muon_momentum=0.9,
        muon_use_nesterov=True,
        muon_fp32_matmul_prec="high",
        muon_scale_mode="unit_rms_norm",
        muon_extra_scale_factor=0.2,
        adam_beta1=0.8,
        adam_beta2=0.95,
        adam_eps=1e-6,
        muon_tp_mode="duplicated",
    )
    kwargs = megatron.optimizer_kwargs(config, schedules[2, "quintic"])
    assert (kwargs["momentum"], kwargs["nesterov"], kwargs["ns_dtype"]) == (0.9, True, "tf32")
    assert (kwargs["update_scale"], kwargs["update_scale_factor"]) == ("unit_rms", 0.2)
    assert (kwargs["adamw_betas"], kwargs["adamw_eps"]) == ((0.8, 0.95), 1e-6)
    config.muon_coefficient_type = "simple"  # later megatron-core releases have the field
    del config.muon_use_nesterov
    config.muon_nesterov = False  # ... and call Nesterov so
    assert not megatron.optimizer_kwargs(config, schedules[2, "simple"])["nesterov"]


@pytest.mark.parametrize(
    "change, tp, needle",
    [
        ({"muon_tp_mode": "blockwise"}, 2, "muon_tp_mode 'blockwise' orthogonalises each TP shard on its own"),
        ({"muon_tp_mode": "sharded"}, 1, "unknown muon_tp_mode 'sharded'"),
        (
            {"muon_num_ns_steps": 6},
            1,
            "the schedule's ns_steps 5 differ from Megatron's ns_steps 6: plan it with --ns-steps 6",
        ),
        ({"muon_split_qkv": False}, 1, "split_qkv qkv differ from Megatron's split_qkv none"),
        ({"decoupled_weight_decay": False}, 1, "decoupled_weight_decay=False"),
        ({"muon_scale_mode": "rms"}, 1, "unknown muon_scale_mode 'rms'"),
        ({"optimizer": "sgd"}, 1, "optimizer 'sgd': the mapping is for Megatron's Muon"),
    ],
)
def test_what_canzona_cannot_reproduce_is_refused(
    change: dict[str, Any], tp: int, needle: str, schedules: dict[tuple[int, str], Schedule]
) -> None:
    config = optimizer_config(**{"optimizer": "muon", "lr": 0.01, "muon_tp_mode": "duplicated", **change})
    with pytest.raises(megatron.MegatronConfigError) as excinfo:
        megatron.optimizer_kwargs(config, schedules[tp, "quintic"])
    assert needle in str(excinfo.value) and "\n" not in str(excinfo.value)


def test_blockwise_is_megatrons_whole_matrix_update_at_tp_1(schedules: dict[tuple[int, str], Schedule]) -> None:
    config = optimizer_config(optimizer="muon", lr=0.01)  # Megatron's default mode
    assert config.muon_tp_mode == "blockwise" and megatron.optimizer_kwargs(config, schedules[1, "quintic"])
    config.muon_coefficient_type = "cans"
    with pytest.raises(megatron.MegatronConfigError, match="muon_coefficient_type 'cans': canzona has the simple"):
        megatron.plan_options(config)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.q_layernorm = nn.LayerNorm(4, bias=False)
        self.embedding = nn.Embedding(8, 4)


def test_param_groups_follow_megatrons_weight_decay_rule() -> None:
    layer = _Layer()
    layer.embedding.weight.is_embedding_or_output_parameter = True  # type: ignore[attr-defined]
    names = lambda group: [name for name, _ in group["params"]]  # noqa: E731
    config = optimizer_config(optimizer="muon", lr=0.01)
    decayed, skipped = megatron.param_groups(layer.named_parameters(), config)
    assert names(decayed) == ["linear.weight", "embedding.weight"] and "adamw_weight_decay" not in decayed
    assert names(skipped) == ["linear.bias", "norm.weight", "norm.bias", "q_layernorm.weight"]
    assert skipped["adamw_weight_decay"] == 0.0 and set(skipped) == {"params", "adamw_weight_decay"}
    config = optimizer_config(optimizer="muon", lr=0.01, apply_wd_to_qk_layernorm=True, decoupled_lr=0.001)
    decayed, skipped, embedding = megatron.param_groups(layer.named_parameters(), config)
    assert names(decayed) == ["linear.weight", "q_layernorm.weight"] and names(embedding) == ["embedding.weight"]
    assert embedding["adamw_lr"] == 0.001


def test_what_is_read_from_megatrons_parameters() -> None:
    shard = torch.empty(6, 4)
    assert megatron.tp_layout(shard) is None
    shard.tensor_model_parallel, shard.partition_dim, shard.partition_stride = True, 0, 2  # type: ignore[attr-defined]
    layout = megatron.tp_layout(shard)
    assert layout == megatron.TpLayout(0, 2) and megatron.global_shape(shard, layout, 4) == (24, 4)
    shard.partition_dim = -1  # type: ignore[attr-defined]
    assert megatron.tp_layout(shard) is None
    config = SimpleNamespace(num_attention_heads=8, num_query_groups=2, kv_channels=16, hidden_size=128)
    owner = SimpleNamespace(config=config)
    assert megatron.qkv_layout("decoder.layers.0.self_attention.linear_qkv.weight", owner, None) == {  # type: ignore[arg-type]
        "query_groups": 2,
        "heads": 8,
        "head_dim": 16,
    }
    assert megatron.qkv_layout("decoder.layers.0.mlp.linear_fc1.weight", owner, None) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "config, needle",
    [
        (None, "no module carries a TransformerConfig"),
        (SimpleNamespace(tensor_model_parallel_size=2, expert_model_parallel_size=2), "holds only its own experts"),
        (
            SimpleNamespace(tensor_model_parallel_size=2, num_moe_experts=4, expert_tensor_parallel_size=1),
            "expert_tensor_parallel_size 1 differs from tensor_model_parallel_size 2",
        ),
    ],
)
def test_a_model_whose_tp_size_cannot_be_read_is_refused(config: Any, needle: str) -> None:
    model = nn.Linear(4, 4)
    model.weight.tensor_model_parallel = True  # type: ignore[attr-defined]
    if config is not None:
        model.config = config  # type: ignore[assignment]
    with pytest.raises(megatron.MegatronConfigError, match=needle):
        megatron.tp_size(model)


def _scaled(rank: int, world: int) -> Any:
    import torch.distributed as dist

    model = nn.Linear(2, 2, bias=False)
    model.weight.grad = torch.full((2, 2), float(rank + 1))
    alone = dist.new_group([rank], use_local_synchronization=True)
    groups = SimpleNamespace(tp=alone, dp_cp=dist.group.WORLD, pp=alone)
    megatron.finalize_model_grads([model], num_tokens=torch.tensor(3.0 + 2 * rank), pg_collection=groups)
    return model.weight.grad


def test_per_token_loss_scales_for_canzonas_dp_mean() -> None:
    """3 and 5 tokens on two DP ranks: each rank's gradient times 2 / 8, so canzona's DP mean is
    Megatron's sum over the 8 tokens."""
    first, second = run_ranks(_scaled, 2)
    assert torch.equal(first, torch.full((2, 2), 0.25)) and torch.equal(second, torch.full((2, 2), 0.5))
