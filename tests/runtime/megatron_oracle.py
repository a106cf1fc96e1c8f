"""Megatron-core's Muon step on full (unsharded) parameters, as an oracle for canzona on a live
megatron-core model.

Two implementations of the same step, which the tests hold canzona to:

- `formula`: written here from Megatron-core 0.16's semantics, not from canzona's rules: the
  EMA momentum `buf.lerp_(g, 1 - μ)`, Nesterov as `g.lerp(buf, μ)`, decoupled weight decay
  before the update, `muon_split_qkv` splitting `linear_qkv` per query group into Q, K and V,
  Newton–Schulz on the short side after `F.normalize(eps=1e-7)` with one (a, b, c) per
  iteration, the scale √max(m, n) · `muon_extra_scale_factor` ("spectral"), and
  `torch.optim.AdamW` for every parameter Megatron gives Adam (the embedding, the output layer
  and the 1-D parameters), without weight decay for 1-D parameters and biases;
- `megatron`: megatron-core's own `TensorParallelMuon` (which needs NVIDIA's
  `emerging_optimizers`, not on the package index: `megatron_muon_available()` says whether it
  imports) with `torch.optim.AdamW`, as `get_megatron_muon_optimizer` chains them.

At TP 1 Megatron's Muon sees each matrix whole, which its "duplicated" TP mode reproduces at
any TP size: the oracle runs on the TP-gathered matrices (fc1's gathered rows interleave its
shards' [gate; up] halves; Newton–Schulz commutes with that row permutation).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from canzona.schedules.coefficients import coefficient_steps
from canzona.schedules.format import Schedule, read_schedule

from rt_harness import canzona_in_child, run_ranks


def megatron_muon_available() -> bool:
    """Whether megatron-core's Muon (through emerging_optimizers) imports here."""
    try:
        return bool(importlib.import_module("megatron.core.optimizer.muon").HAVE_EMERGING_OPTIMIZERS)
    except Exception:
        return False


def _orthogonalize(x: Tensor, steps: int, coefficients: str) -> Tensor:
    """Newton–Schulz as Megatron runs it (fp32, highest matmul precision)."""
    transpose = x.size(0) > x.size(1)
    if transpose:
        x = x.T
    x = F.normalize(x, p=2, dim=(-2, -1), eps=1e-7)
    for a, b, c in coefficient_steps(coefficients, steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, alpha=c, beta=b)
        x = torch.addmm(x, poly, x, alpha=1.0, beta=a)
    return x.T if transpose else x


class MegatronMuonReference:
    """Megatron's Muon + AdamW on `params` (name -> full fp32 tensor): `muon` names the matrices
    Muon updates, `qkv_split` the fused QKV matrices' (q rows, k rows, v rows) per query group;
    `config` is Megatron's `OptimizerConfig`. `backend`: "formula" (fp32), "formula64" (the same
    in fp64: the yardstick of fp32 rounding) or "megatron" (megatron-core's TensorParallelMuon).
    `shards` (name -> TP dim and size) lets the formula run Megatron's "blockwise" TP mode, which
    orthogonalises each TP shard on its own."""

    def __init__(
        self,
        params: Mapping[str, Tensor],
        muon: set[str],
        qkv_split: tuple[int, int, int],
        config: Any,
        coefficients: str,
        backend: str = "formula",
        shards: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        dtype = torch.float64 if backend == "formula64" else torch.float32
        self.params = {name: torch.nn.Parameter(value.detach().to(dtype, copy=True)) for name, value in params.items()}
        self.muon, self.qkv_split, self.config, self.coefficients = muon, qkv_split, config, coefficients
        self.nesterov = bool(getattr(config, "muon_use_nesterov", getattr(config, "muon_nesterov", False)))
        self.shards = dict(shards or {})  # name -> (TP dim, TP size): blockwise orthogonalises each shard
        self.momenta: dict[str, Tensor] = {}
        adam = [name for name in self.params if name not in muon]
        decayed = [self.params[n] for n in adam if not (self.params[n].dim() == 1 or n.endswith(".bias"))]
        skipped = [self.params[n] for n in adam if self.params[n].dim() == 1 or n.endswith(".bias")]
        self.adam = torch.optim.AdamW(
            [{"params": decayed, "weight_decay": config.weight_decay}, {"params": skipped, "weight_decay": 0.0}],
            lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2),
            eps=config.adam_eps,
        )
        self.megatron = self._megatron_muon() if backend == "megatron" else None

    def _megatron_muon(self) -> Any:
        from megatron.core.optimizer.muon import TensorParallelMuon

        matrices = [self.params[name] for name in self.params if name in self.muon]
        for name in self.muon:
            self.params[name].is_qkv = name.endswith("linear_qkv.weight")  # type: ignore[attr-defined]
        c = self.config
        return TensorParallelMuon(
            matrices,
            lr=c.lr,
            momentum_beta=c.muon_momentum,
            use_nesterov=self.nesterov,
            weight_decay=c.weight_decay,
            split_qkv=c.muon_split_qkv,
            is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
            qkv_split_shapes=self.qkv_split,
            fp32_matmul_prec=c.muon_fp32_matmul_prec,
            coefficient_type=self.coefficients,
            num_ns_steps=c.muon_num_ns_steps,
            scale_mode=c.muon_scale_mode,
            extra_scale_factor=c.muon_extra_scale_factor,
            pg_collection=None,
            mode="duplicated",
        )

    def step(self, grads: Mapping[str, Tensor]) -> None:
        """One step on the full gradients `grads` (DP-averaged, TP-gathered)."""
        for name, param in self.params.items():
            param.grad = grads[name].detach().to(param.dtype, copy=True)
        self.adam.step()
        if self.megatron is not None:
            self.megatron.step()
        else:
            with torch.no_grad():
                for name in self.muon:
                    self._muon_step(name)

    def _muon_step(self, name: str) -> None:
        c, param = self.config, self.params[name]
        grad = param.grad
        assert grad is not None
        buf = self.momenta.setdefault(name, torch.zeros_like(param))
        param.mul_(1 - c.lr * c.weight_decay)
        buf.lerp_(grad, 1 - c.muon_momentum)
        direction = grad.lerp(buf, c.muon_momentum) if self.nesterov else buf
        param.add_(self._update(name, direction), alpha=-c.lr)

    def _update(self, name: str, direction: Tensor) -> Tensor:
        dim, size = self.shards.get(name, (0, 1))
        if getattr(self.config, "muon_tp_mode", "duplicated") == "blockwise" and size > 1:
            return torch.cat([self._whole(name, piece) for piece in direction.chunk(size, dim)], dim)
        return self._whole(name, direction)

    def _whole(self, name: str, direction: Tensor) -> Tensor:
        c = self.config
        if not (c.muon_split_qkv and name.endswith("linear_qkv.weight")):
            return self._scaled(direction)
        groups = direction.size(0) // sum(self.qkv_split)
        pieces = direction.view(groups, sum(self.qkv_split), -1).split(list(self.qkv_split), dim=1)
        updates = [
            self._scaled(piece.reshape(-1, direction.size(1))).view(groups, -1, direction.size(1)) for piece in pieces
        ]
        return torch.cat(updates, dim=1).view_as(direction)

    def _scaled(self, x: Tensor) -> Tensor:
        c = self.config
        return (
            _orthogonalize(x, c.muon_num_ns_steps, self.coefficients) * max(x.shape) ** 0.5 * c.muon_extra_scale_factor
        )


# ---------------------------------------------------------------------------------------------
# canzona on the example's GPTModel against the oracle, on gloo ranks


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "megatron_gpt.py"
STEPS = 3
CPU = torch.device("cpu")
FACTORY = {1: "make_model", 2: "make_model_tp2"}


def example() -> Any:
    """examples/megatron_gpt.py as a module."""
    spec = importlib.util.spec_from_file_location("megatron_gpt", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def plan(tmp_path: Path, tp: int, dp: int, *flags: str) -> Schedule:
    """One `canzona plan --model py:examples/megatron_gpt.py:FACTORY` command's schedule."""
    out = tmp_path / f"mcore-tp{tp}-dp{dp}-{len(flags)}.yaml"
    canzona_in_child(
        [
            "plan",
            "--model",
            f"py:{EXAMPLE}:{FACTORY[tp]}",
            "--tp",
            str(tp),
            "--dp",
            str(dp),
            "--bucket-size",
            "20000",
            "--group-mb",
            "0.05",
            "-o",
            str(out),
            *flags,
        ]
    )
    return read_schedule(out)


def _gathered(model: torch.nn.Module, tp_group: Any, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or gradient: `main_grad` where Megatron's DDP keeps it) of the model, its
    TP shards concatenated along `partition_dim`, as fp32 copies on the model's device."""
    import torch.distributed as dist

    full = {}
    size = dist.get_world_size(tp_group)
    for name, param in model.named_parameters():
        value = (getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad) if grads else param
        value = value.detach()
        dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
        if dim >= 0 and size > 1:
            parts = [torch.empty_like(value) for _ in range(size)]
            dist.all_gather(parts, value.contiguous(), group=tp_group)
            value = torch.cat(parts, dim=dim)
        full[name] = value.float().clone()
    return full


def train_against_oracle(
    schedule: Schedule,
    overrides: dict[str, Any],
    backends: tuple[str, ...],
    reference_overrides: dict[str, Any],
    device: torch.device = CPU,
) -> Any:
    """Train the example's model STEPS steps with canzona (Megatron's config with `overrides`)
    and, on the same gradients, the oracle (with `reference_overrides` on top), on this rank of
    an initialised process group; on CUDA the model is wrapped in Megatron's
    DistributedDataParallel and canzona reads its `main_grad`. Global rank 0 returns both runs'
    full parameters and the initial ones."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from canzona.runtime import CanzonaOptimizer
    from canzona.runtime.integrations import megatron as cz_megatron

    gpt = example()
    gpt.run_megatron_on_cpu()
    tp, cuda = schedule.request.tp, device.type == "cuda"
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, distributed_timeout_minutes=1)
    torch.manual_seed(0)
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)  # Megatron forks its CUDA RNG around attention, dropout or not
    model = gpt.build(tp).to(device)
    wrapped = gpt.wrap_for_gpu(model) if cuda else model
    config = megatron_config(gpt, overrides)
    tp_group, dp_group = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_data_parallel_group()
    optimizer = CanzonaOptimizer(
        cz_megatron.param_groups(model.named_parameters(), config),
        schedule,
        dp_group=dp_group,
        tp_group=tp_group,
        grad_attr="main_grad" if cuda else "grad",
        **cz_megatron.optimizer_kwargs(config, schedule),
    )
    initial = {name: value.cpu() for name, value in _gathered(model, tp_group).items()}
    muon = {e.name for e in schedule.params if e.optimizer == "matrix"}
    qkv_split = (2 * 16, 16, 16)  # per query group: 2 heads of 16 rows, k, v
    theirs = megatron_config(gpt, {**overrides, **reference_overrides})
    coefficients = cz_megatron.plan_options(theirs)["ns_coefficients"]
    shards = {
        name: (param.partition_dim, tp)
        for name, param in model.named_parameters()
        if getattr(param, "tensor_model_parallel", False) and param.partition_dim >= 0
    }
    references = {
        backend: MegatronMuonReference(initial, muon, qkv_split, theirs, coefficients, backend, shards)
        for backend in backends
    }
    causal = torch.ones(gpt.SEQ, gpt.SEQ, dtype=torch.bool, device=device).triu(1)[None, None]
    positions = torch.arange(gpt.SEQ, device=device).unsqueeze(0).expand(2, -1)
    for step in range(STEPS):
        tokens, labels = gpt.batch(step, parallel_state.get_data_parallel_rank(), device)
        wrapped(tokens, positions, causal, labels=labels).mean().backward()
        cz_megatron.finalize_model_grads([model])
        grads = _gathered(model, tp_group, grads=True)
        for grad in grads.values():
            dist.all_reduce(grad, group=dp_group)
            grad.div_(dist.get_world_size(dp_group))
        for reference in references.values():
            reference.step({name: grad.cpu() for name, grad in grads.items()})
        optimizer.step()
        if cuda:
            wrapped.zero_grad_buffer()
        optimizer.zero_grad()
    final = {name: value.cpu() for name, value in _gathered(model, tp_group).items()}
    if dist.get_rank() != 0:
        return None
    return {
        "canzona": final,
        "initial": initial,
        "references": {backend: {n: p.detach() for n, p in ref.params.items()} for backend, ref in references.items()},
    }


def _train(
    rank: int,
    world: int,
    schedule: Schedule,
    overrides: dict[str, Any],
    backends: tuple[str, ...],
    reference_overrides: dict[str, Any],
) -> Any:
    """`train_against_oracle` on one of the harness's gloo ranks."""
    return train_against_oracle(schedule, overrides, backends, reference_overrides)


def megatron_config(gpt: Any, overrides: dict[str, Any]) -> Any:
    """Megatron's `OptimizerConfig` of the example at fp32 Newton-Schulz, with `overrides`
    (`muon_coefficient_type`, a field of later megatron-core releases, set as an attribute)."""
    fields = {key: value for key, value in overrides.items() if key != "muon_coefficient_type"}
    config = gpt.optimizer_config(muon_fp32_matmul_prec="highest", **fields)
    if "muon_coefficient_type" in overrides:
        config.muon_coefficient_type = overrides["muon_coefficient_type"]
    return config


def parity_error(run: dict[str, Tensor], reference: dict[str, Tensor], initial: dict[str, Tensor]) -> tuple[float, str]:
    """(max over parameters of max |run − reference| / max |reference − initial|, the worst parameter)."""
    worst, where = 0.0, ""
    for name, ours in run.items():
        ref, start = reference[name].double(), initial[name].double()
        moved = float((ref - start).abs().max())
        difference = float((ours.double() - ref).abs().max())
        error = difference / moved if moved > 0 else difference
        if error > worst or not where:
            worst, where = error, name
    return worst, where


def run_parity_runs(
    tmp_path: Path,
    tp: int,
    dp: int,
    flags: tuple[str, ...] = (),
    overrides: dict[str, Any] | None = None,
    backends: tuple[str, ...] = ("formula",),
    reference_overrides: dict[str, Any] | None = None,
) -> Any:
    """Plan with `flags`, train on tp x dp gloo ranks; canzona's, the initial and each backend's parameters."""
    schedule = plan(tmp_path, tp, dp, *flags)
    return run_ranks(_train, tp * dp, schedule, overrides or {}, backends, reference_overrides or {}, timeout=180)[0]


def run_parity(
    tmp_path: Path,
    tp: int,
    dp: int,
    flags: tuple[str, ...] = (),
    overrides: dict[str, Any] | None = None,
    backend: str = "formula",
    reference_overrides: dict[str, Any] | None = None,
) -> tuple[float, str]:
    """Plan with `flags`, train on tp x dp gloo ranks; the parity error against `backend`."""
    result = run_parity_runs(tmp_path, tp, dp, flags, overrides, (backend,), reference_overrides)
    return parity_error(result["canzona"], result["references"][backend], result["initial"])
