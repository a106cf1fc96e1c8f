"""torchtitan: canzona as the trainer's optimizer (docs/torchtitan.md).

torchtitan builds its optimizer from the trainer config (`Trainer.Config.optimizer`, an
`OptimizersContainer.Config`) after parallelizing the model, and always wraps the model in
FSDP2, so canzona runs there as `FsdpOptimizer`, under a schedule planned with `--fsdp`:

    optimizer=CanzonaOptimizersContainer.Config(
        schedule="schedules/qwen3-8b/muon-tp2-dp4-fsdp-torchtitan.yaml",
        hyperparameters={"lr": 0.02, "adamw_lr": 3e-4, "weight_decay": 0.1},
    )

The container keeps torchtitan's contract: `step`, `zero_grad`, iteration over its optimizers
(the LR schedulers wrap each), and `state_dict` / `load_state_dict` for torchtitan's distributed
checkpoint. FSDP optimizer state is per device (each host keeps its matrices' whole state), so
each rank saves its own state under its own key and a checkpoint resumes on the same layout.

torchtitan is imported here, at module level: import this module only where it is installed
(`pip install 'canzona[titan]'`).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer

from canzona.runtime import FsdpOptimizer

STATE_KEY = "canzona_fsdp"  # each rank's entry is STATE_KEY.rank<R>.of<W>


class CanzonaOptimizersContainer(OptimizersContainer):
    """torchtitan's `OptimizersContainer` holding one canzona `FsdpOptimizer` over the model's
    parameters. `Config.schedule` is the schedule file; `Config.hyperparameters` are
    FsdpOptimizer's keyword arguments (`lr`, `adamw_lr`, `momentum`, `weight_decay`, ...);
    `param_groups` must stay empty (the schedule says which parameters are matrices)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        schedule: str = ""
        """The schedule file (`canzona plan ... --fsdp --names torchtitan`, or from the live model)."""

        hyperparameters: dict[str, Any] = field(default_factory=dict)
        """FsdpOptimizer's hyperparameters, as keyword arguments."""

        timeout_seconds: float = 600.0
        """Bound on each of canzona's collectives: a failure raises on every rank, never hangs."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        _check_config(config, model_parts)
        model = model_parts[0]
        optimizer = FsdpOptimizer(
            model.named_parameters(),
            config.schedule,
            timeout=timedelta(seconds=config.timeout_seconds),
            **config.hyperparameters,
        )
        self.optimizers = [optimizer]
        self.model_parts = model_parts
        # torch.optim.Optimizer's own set-up (hooks such as torchtitan's MoE load balancing step
        # pre-hook need it), as torchtitan's container does after building its optimizers
        torch.optim.Optimizer.__init__(self, [p for p in model.parameters() if p.requires_grad], {})

    @property
    def canzona(self) -> FsdpOptimizer:
        """The canzona optimizer inside."""
        return self.optimizers[0]

    def state_dict(self) -> dict[str, Any]:
        """This rank's FsdpOptimizer state, serialized, under this rank's own key (torchtitan's
        distributed checkpoint saves every rank's entry)."""
        buffer = io.BytesIO()
        torch.save(self.canzona.state_dict(), buffer)
        return {_rank_key(): buffer.getvalue()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's entry of a checkpoint saved under the same schedule and layout;
        ValueError when there is none."""
        data = state_dict.get(_rank_key())
        if not isinstance(data, bytes) or not data:
            saved = sorted(k for k in state_dict if k.startswith(STATE_KEY)) or ["none"]
            raise ValueError(
                f"canzona: the checkpoint has no optimizer state for {_rank_key()} (it holds {saved[0]}"
                f"{' ...' if len(saved) > 1 else ''}): FSDP optimizer state resumes on the layout it was "
                "saved with"
            )
        state = torch.load(io.BytesIO(data), map_location=self.canzona.device, weights_only=True)
        self.canzona.load_state_dict(state)


def _rank_key() -> str:
    return f"{STATE_KEY}.rank{dist.get_rank()}.of{dist.get_world_size()}"


def _check_config(config: CanzonaOptimizersContainer.Config, model_parts: list[nn.Module]) -> None:
    """ValueError for a config or model canzona cannot run as torchtitan's optimizer."""
    if not config.schedule:
        raise ValueError("canzona: set optimizer.schedule to the schedule file (canzona plan ... --fsdp)")
    if config.param_groups:
        raise ValueError(
            "canzona: optimizer.param_groups must be empty: the schedule says which parameters are "
            "matrices; set the learning rates in optimizer.hyperparameters (lr, adamw_lr)"
        )
    if len(model_parts) != 1:
        raise ValueError(
            f"canzona: the model is in {len(model_parts)} pipeline stages; canzona plans one model "
            "(pipeline parallelism is not supported)"
        )
