"""A megatron-core `GPTModel` (a tiny Qwen3: 2 layers, hidden 64, 4 heads in 2 query groups,
qk-layernorm, SwiGLU, RMSNorm) trained with canzona: Megatron builds the model, its tensor-parallel
layers and its process groups; canzona reduces the gradients over DP and runs Megatron's Muon
(`canzona.runtime.integrations.megatron` maps Megatron's `OptimizerConfig` onto canzona).

    canzona plan --model py:examples/megatron_gpt.py:make_model_tp2 --tp 2 --dp 2 \\
        --ns-coefficients quintic --bucket-size 20000 --group-mb 0.05 -o /tmp/mcore.yaml
    torchrun --standalone --nproc-per-node 4 examples/megatron_gpt.py --schedule /tmp/mcore.yaml

`make_model` (TP 1) and `make_model_tp2` build the model on the meta device over a fake process
group, so that `canzona plan` reads Megatron's own layout (TP shards, fused QKV groups, fc1's
[gate; up]) without a cluster. `--spec te` builds Transformer Engine's layer spec (it needs
transformer_engine and a GPU); the default is Megatron's local spec, which runs on CPUs too.

On GPUs the model is wrapped in Megatron's `DistributedDataParallel` (fp32 `main_grad`
buffers, overlap and the DP reduction off) and canzona reads `main_grad`; on CPUs, where that
wrapper needs CUDA, canzona reads `.grad`. Either way `finalize_model_grads` runs Megatron's
TP-side sums (here: the qk-layernorm gradients) and leaves the DP reduction to canzona, and the
global rank is dp_rank * tp + tp_rank, Megatron's order as canzona's.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

MODEL: dict[str, Any] = dict(
    num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16, ffn_hidden_size=160
)
VOCAB, SEQ = 256, 16


def transformer_config(tp: int, **overrides: Any) -> Any:
    """The model's `TransformerConfig` at TP size `tp` (fp32 parameters, initialised on the CPU)."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        **MODEL,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        normalization="RMSNorm",
        qk_layernorm=True,
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        params_dtype=torch.float32,
        **overrides,
    )


def run_megatron_on_cpu() -> None:
    """Without CUDA, let megatron-core 0.16's local spec run on the CPU. It touches CUDA in two
    places besides its default causal mask (`train` passes its own): it allocates the attention
    scores and the rotary table on `torch.cuda.current_device()`, pointed here at the CPU, and
    forks the CUDA RNG tracker around attention dropout, which this model does not use
    (dropout 0), so the fork becomes a no-op."""
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    get_cuda_rng_tracker().fork = lambda *args, **kwargs: contextlib.nullcontext()  # type: ignore[method-assign]


def build(tp: int, spec: str = "local", **overrides: Any) -> nn.Module:
    """The `GPTModel` at TP size `tp` (Megatron's parallel state must be initialised for it)."""
    from megatron.core.models.gpt import GPTModel, gpt_layer_specs

    if spec == "te":
        layers = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=True)
    else:
        layers = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    return GPTModel(
        config=transformer_config(tp, **overrides),
        transformer_layer_spec=layers,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    )


def _fake_parallel_state(tp: int) -> None:
    """Megatron's parallel state over a fake process group of `tp` ranks (planning needs no
    cluster). `canzona check` may describe several models in one process: a state of another
    TP size is replaced."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers the "fake" backend
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == tp:
            return
        parallel_state.destroy_model_parallel()
    if dist.is_initialized() and dist.get_world_size() != tp:
        dist.destroy_process_group()
    if not dist.is_initialized():
        dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=tp)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)


def make_model() -> nn.Module:
    """The model at TP 1, for `canzona plan --model py:examples/megatron_gpt.py:make_model`."""
    _fake_parallel_state(1)
    return build(1)


def make_model_tp2() -> nn.Module:
    """The model at TP 2 (each rank's shards), for `canzona plan ... --tp 2`."""
    _fake_parallel_state(2)
    return build(2)


def make_model_te() -> nn.Module:
    """The model at TP 1 on Transformer Engine's layer spec (needs transformer_engine)."""
    _fake_parallel_state(1)
    return build(1, "te")


def optimizer_config(**overrides: Any) -> Any:
    """Megatron's Muon settings this example trains with (Megatron's defaults, at its 'duplicated'
    TP mode, which canzona's whole-matrix update is)."""
    from megatron.core.optimizer import OptimizerConfig

    settings: dict[str, Any] = dict(optimizer="muon", lr=0.005, weight_decay=0.01, muon_tp_mode="duplicated")
    return OptimizerConfig(**{**settings, **overrides})


def batch(step: int, dp_rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This DP rank's token batch and labels of `step` (2 sequences of SEQ tokens; 4 batches per
    rank in turn, so the loss falls as the model learns them)."""
    generator = torch.Generator().manual_seed(1000 * (step % 4) + dp_rank)
    tokens = torch.randint(0, VOCAB, (2, SEQ + 1), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)


def wrap_for_gpu(model: nn.Module, optimizer_hook: Any = None) -> nn.Module:
    """Megatron's DistributedDataParallel with its DP reduction off: fp32 `main_grad` buffers
    that canzona reads (docs/megatron.md)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp, module=model)


def train(schedule_path: str, steps: int, spec: str) -> float:
    """Train the model `steps` steps under the schedule's DP x TP layout; the last loss."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from canzona.runtime import CanzonaOptimizer, load_schedule
    from canzona.runtime.integrations import megatron as cz_megatron

    sys.path.insert(0, os.path.dirname(__file__))
    from launch import init_distributed

    device = init_distributed(timedelta(minutes=2))
    schedule = load_schedule(schedule_path)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=schedule.request.tp, distributed_timeout_minutes=2
    )
    torch.manual_seed(0)  # the same master weights on every rank (TP shards are cut from them)
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(0)
    run_megatron_on_cpu()
    model = build(schedule.request.tp, spec).to(device)
    config = optimizer_config(muon_fp32_matmul_prec="medium" if device.type == "cuda" else "highest")
    cuda = device.type == "cuda"
    unwrapped = model
    if cuda:
        model = wrap_for_gpu(model)
    optimizer = CanzonaOptimizer(
        cz_megatron.param_groups(unwrapped.named_parameters(), config),
        schedule,
        dp_group=parallel_state.get_data_parallel_group(),
        tp_group=parallel_state.get_tensor_model_parallel_group(),
        grad_attr="main_grad" if cuda else "grad",
        **cz_megatron.optimizer_kwargs(config, schedule),
    )
    dp_rank = parallel_state.get_data_parallel_rank()
    position_ids = torch.arange(SEQ, device=device).unsqueeze(0).expand(2, -1)
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool, device=device).triu(1)[None, None]  # True: masked out
    loss, first = torch.zeros((), device=device), None
    for step in range(steps):
        tokens, labels = batch(step, dp_rank, device)
        loss = model(tokens, position_ids, causal, labels=labels).mean()
        loss.backward()
        cz_megatron.finalize_model_grads([unwrapped])  # Megatron's TP sums; canzona reduces over DP
        norm = optimizer.clip_grad_norm_(1.0)
        optimizer.step()
        if cuda:
            model.zero_grad_buffer()  # Megatron zeroes its main_grad buffers
        optimizer.zero_grad()
        first = float(loss.item()) if first is None else first
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}  grad norm {float(norm):.4f}")
    if dist.get_rank() == 0:
        print(f"loss {first:.4f} -> {loss.item():.4f}")
    return float(loss.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", required=True, help="a schedule planned from make_model / make_model_tp2")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--spec", choices=("local", "te"), default="local", help="Megatron's layer spec")
    arguments = parser.parse_args()
    train(arguments.schedule, arguments.steps, arguments.spec)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
