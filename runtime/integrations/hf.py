"""Hugging Face: transformers' `Trainer` and accelerate with canzona in DDP's place (docs/hf.md).

canzona reduces the gradients over DP itself, at its schedule's cuts, so the model must not be
wrapped in `DistributedDataParallel` as well (that reduces every gradient a second time), and
everything that reads gradients before the step must see canzona's reduced ones:

- `CanzonaTrainer`, a `transformers.Trainer`: leaves the model unwrapped (accelerate still
  applies mixed precision and compilation), clips with `max_grad_norm` on the reduced gradient
  (`CanzonaOptimizer.clip_grad_norm_`) and logs its norm, accumulates through canzona's
  `no_sync`, and saves and resumes the optimizer through canzona's checkpoints, every rank its
  own state, beside the Trainer's own files. It refuses an optimizer that is not canzona's, and
  `FsdpOptimizer` (FSDP2 is not wired into the Trainer or accelerate yet).
- `CanzonaOptimizerFactory`, for `Trainer(optimizer_cls_and_kwargs=(CanzonaOptimizerFactory,
  {"schedule": ..., ...}))`: builds the optimizer from the model's named parameters.
- `prepare(accelerator, model, optimizer, ...)`: `accelerator.prepare` without the DDP wrapper,
  with the accelerator's `clip_grad_norm_` of the model's parameters and its `no_sync` routed to
  canzona, and `save_state` / `load_state` saving and loading canzona's checkpoint.

transformers and accelerate are imported here, at module level: import this module only where
they are installed (`pip install 'canzona[hf]'`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer

from canzona.runtime import CanzonaOptimizer, FsdpOptimizer, load_checkpoint, make_groups, save_checkpoint

CHECKPOINT = "canzona_optimizer"  # the folder beside the Trainer's (or accelerate's) checkpoint files
SCHEDULER = "scheduler.pt"  # the Trainer's own name for its LR scheduler's state
MARKER = {"canzona": CHECKPOINT}  # what accelerate's optimizer.bin holds: the state lives in CHECKPOINT


def canzona_optimizer(optimizer: Any) -> CanzonaOptimizer:
    """The `CanzonaOptimizer` inside `optimizer` (accelerate wraps it in `AcceleratedOptimizer`);
    TypeError when there is none, or when it is an `FsdpOptimizer` (FSDP2 is not wired into the
    Trainer or accelerate yet, docs/hf.md)."""
    inner = _inner_canzona(optimizer)
    if inner is None:
        raise TypeError(
            f"the optimizer is {type(optimizer).__name__}, not canzona's: canzona takes DDP's place, so "
            "training with another optimizer here would not reduce the gradients over DP"
        )
    if isinstance(inner, FsdpOptimizer):
        raise TypeError(
            "FsdpOptimizer under transformers' Trainer or accelerate is not supported yet: train an FSDP2 "
            "model with the plain loop of examples/fsdp_qwen3.py"
        )
    return inner


def _inner_canzona(optimizer: Any) -> CanzonaOptimizer | FsdpOptimizer | None:
    """The canzona optimizer `optimizer` is or wraps, if any."""
    inner = optimizer
    while isinstance(inner, torch.optim.Optimizer) and not isinstance(inner, (CanzonaOptimizer, FsdpOptimizer)):
        inner = getattr(inner, "optimizer", None)
    return inner if isinstance(inner, (CanzonaOptimizer, FsdpOptimizer)) else None


class CanzonaOptimizerFactory:
    """`Trainer(optimizer_cls_and_kwargs=(CanzonaOptimizerFactory, kwargs))`: the Trainer calls
    `CanzonaOptimizerFactory()(model, **kwargs)`. `kwargs` are `CanzonaOptimizer`'s (`schedule`,
    the hyperparameters, optionally `dp_group` / `tp_group`; by default DP over every rank, TP
    1); `weight_decay` follows the Trainer's rule: matrices take it, and so do the AdamW
    parameters the Trainer decays (not biases or norms), as `adamw_weight_decay`."""

    def __call__(
        self, model: nn.Module, *, schedule: Any, weight_decay: float = 0.0, **kwargs: Any
    ) -> CanzonaOptimizer:
        """The optimizer of `model`'s named parameters."""
        if "dp_group" not in kwargs and "tp_group" not in kwargs and "mesh" not in kwargs:
            kwargs["dp_group"], kwargs["tp_group"] = make_groups(dp=dist.get_world_size(), tp=1)
        kwargs.setdefault("adamw_weight_decay", weight_decay)
        return CanzonaOptimizer(trainer_param_groups(model), schedule, weight_decay=weight_decay, **kwargs)


def trainer_param_groups(model: nn.Module) -> list[dict[str, Any]]:
    """`model`'s trainable named parameters in the Trainer's two groups: those it decays, and the
    biases and norms, whose `adamw_weight_decay` is 0 (the Trainer's own rule, from the installed
    transformers: `Trainer.get_decay_parameter_names`, which reads nothing of the Trainer)."""
    # no Trainer exists yet when the optimizer is built, and the method never reads `self`
    decayed = set(Trainer.get_decay_parameter_names(None, model))  # type: ignore[arg-type]
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    groups: list[dict[str, Any]] = [
        {"params": [(n, p) for n, p in named if n in decayed]},
        {"params": [(n, p) for n, p in named if n not in decayed], "adamw_weight_decay": 0.0},
    ]
    return [group for group in groups if group["params"]]


def _attach_no_sync(model: nn.Module, optimizer: CanzonaOptimizer) -> None:
    """accelerate's `no_sync(model)` (the Trainer's and `accumulate`'s) uses the model's own
    `no_sync` in a distributed run: make it canzona's, which holds back the reduction."""
    # nn.Module's stubs type every attribute as a tensor or a module; a bound method is stored as usual
    model.no_sync = optimizer.no_sync  # type: ignore[assignment]


def _prepare_without_ddp(accelerator: Any, model: nn.Module) -> nn.Module:
    """accelerate's preparation of `model` but for the DDP wrapper (mixed precision, compilation,
    device placement: its `evaluation_mode`). accelerate marks what it prepared, so the
    `accelerator.prepare` that follows passes the model through (and so does a second call)."""
    return accelerator.prepare_model(model, evaluation_mode=True)


class CanzonaTrainer(Trainer):
    """`transformers.Trainer` with canzona in DDP's place (module docstring). Give it canzona's
    optimizer as `optimizers=(CanzonaOptimizer(...), scheduler)` or through
    `optimizer_cls_and_kwargs=(CanzonaOptimizerFactory, {...})`; everything else is the
    Trainer's: `max_grad_norm`, `gradient_accumulation_steps`, the LR scheduler, `save_steps`
    and `resume_from_checkpoint`."""

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if not training:
            return super()._wrap_model(model, training, dataloader)
        optimizer = canzona_optimizer(self.optimizer)
        if self.args.n_gpu > 1:
            raise ValueError("canzona runs one process per device (torchrun), not nn.DataParallel over several GPUs")
        prepared = _prepare_without_ddp(self.accelerator, model)
        _attach_no_sync(prepared, optimizer)
        return prepared

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return canzona_optimizer(self.optimizer).clip_grad_norm_(self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:  # the norm of the reduced gradient, for the logs (clipping nothing)
            grad_norm = canzona_optimizer(self.optimizer).clip_grad_norm_(math.inf)
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_checkpoint(canzona_optimizer(self.optimizer), os.path.join(output_dir, CHECKPOINT))
        if self.args.should_save:
            assert self.lr_scheduler is not None  # the Trainer creates it with the optimizer, before any save
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        load_checkpoint(canzona_optimizer(self.optimizer), os.path.join(checkpoint, CHECKPOINT))
        state = torch.load(os.path.join(checkpoint, SCHEDULER), map_location="cpu", weights_only=True)
        assert self.lr_scheduler is not None  # the Trainer creates it with the optimizer, before loading them
        self.lr_scheduler.load_state_dict(state)


def prepare(accelerator: Any, *objects: Any) -> Any:
    """`accelerator.prepare(*objects)` for a canzona optimizer among them: the model(s) are
    prepared without the DDP wrapper (canzona reduces over DP), the accelerator's
    `clip_grad_norm_` of the optimized parameters clips canzona's reduced gradient, its
    `no_sync` / `accumulate` hold back canzona's reduction, and `save_state` / `load_state` save
    and load canzona's checkpoint in a `canzona_optimizer` folder (every rank its state) instead
    of one rank's state dict. Returns what `accelerator.prepare` returns."""
    optimizers = [canzona_optimizer(obj) for obj in objects if _is_canzona(obj)]
    if len(optimizers) != 1:
        raise ValueError(f"prepare takes exactly one canzona optimizer among its objects, got {len(optimizers)}")
    optimizer = optimizers[0]
    models = [_prepare_without_ddp(accelerator, obj) if isinstance(obj, nn.Module) else obj for obj in objects]
    for model in models:
        if isinstance(model, nn.Module):
            _attach_no_sync(model, optimizer)
    prepared = accelerator.prepare(*models)
    results = prepared if isinstance(prepared, tuple) else (prepared,)
    for result in results:
        if _is_canzona(result) and result is not optimizer:
            _checkpoint_through_canzona(accelerator, result, optimizer)
    _clip_through_canzona(accelerator, optimizer)
    return prepared


def _is_canzona(obj: Any) -> bool:
    """Whether `obj` is or wraps a canzona optimizer (an `FsdpOptimizer` too, which
    `canzona_optimizer` then refuses in its own words)."""
    return _inner_canzona(obj) is not None


def _clip_through_canzona(accelerator: Any, optimizer: CanzonaOptimizer) -> None:
    """Route the accelerator's `clip_grad_norm_` of exactly the optimized parameters to canzona
    (the local, unreduced gradients would give another norm); other parameters keep accelerate's."""
    original = accelerator.clip_grad_norm_
    managed = {id(param) for group in optimizer.param_groups for param in group["params"]}

    def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2) -> torch.Tensor:
        params = list(parameters)
        trainable = {id(p) for p in params if p.requires_grad}
        if trainable and trainable <= managed:
            return optimizer.clip_grad_norm_(max_norm, norm_type)
        return original(params, max_norm, norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_


def _checkpoint_through_canzona(accelerator: Any, wrapped: Any, optimizer: CanzonaOptimizer) -> None:
    """`save_state` / `load_state` save and load canzona's checkpoint on every rank (hooks that
    run on every rank before accelerate's own files); the wrapped optimizer's state dict becomes a
    marker naming that folder, so accelerate's single optimizer file holds no rank's state."""

    def save(models: Any, weights: Any, output_dir: str) -> None:
        save_checkpoint(optimizer, os.path.join(output_dir, CHECKPOINT))

    def load(models: Any, input_dir: str) -> None:
        load_checkpoint(optimizer, os.path.join(input_dir, CHECKPOINT))

    def load_state_dict(state_dict: dict[str, Any]) -> None:
        if state_dict != MARKER:
            raise ValueError(
                f"not a canzona checkpoint marker ({MARKER}): canzona's state is loaded from its "
                f"{CHECKPOINT} folder by load_state"
            )

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    wrapped.state_dict = lambda: dict(MARKER)
    wrapped.load_state_dict = load_state_dict
