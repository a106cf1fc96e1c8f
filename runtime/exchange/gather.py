"""The DP parameter gather of one step, bucket by bucket, and its overlap with the next forward.

`ParamGather` launches every bucket's gather (`canzona.runtime.exchange.comm.start_gather`) in the
layout's gather order (the bucket the next forward needs first, first) and writes a bucket's
new values into the parameters once it has arrived. Without `overlap_param_gather` the step
waits for all of them before it returns. With it the step returns at once and `ForwardHooks`
wait, module by module, for the buckets holding the parameters a module is about to use (a
forward pre-hook), so the next forward starts while later buckets are still in flight.

Which buckets a module waits for: those of its own parameters and of the parameters of its
submodules that have no `forward` of their own (holders such as a weight container), whose
parameters its forward must be using itself. A module with no parameter to wait for gets no
hook. Everything else that reads the parameters first waits for every bucket: the end of the
model's forward, the model's `state_dict` / `load_state_dict`, the optimizer's next step,
`state_dict`, `load_state_dict`, checkpoints and `finish_gather()`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from canzona.runtime.exchange.comm import Pending

if TYPE_CHECKING:
    from canzona.runtime.optimizer import CanzonaOptimizer

WHAT = "the DP gather of updated parameters"


class ParamGather:
    """The gathers of one step: `out` is this rank's new values (region coordinates, in the
    dtype they travel in), `active` which parameters the step changed."""

    def __init__(self, opt: CanzonaOptimizer, out: Tensor, active: list[bool]) -> None:
        self.opt = opt
        self.gathered = torch.empty(opt.layout.total, dtype=out.dtype, device=out.device)
        self.targets = opt._targets(active)
        self.pending: dict[int, Pending] = {}
        for bucket in opt.layout.gather_order:
            self.pending[bucket] = opt._start_gather(bucket, self.gathered, out)

    @property
    def done(self) -> bool:
        """Whether every bucket has arrived and been written."""
        return not self.pending

    def wait(self, buckets: Iterable[int]) -> None:
        """Wait for `buckets` (those not arrived yet) and write their values into the
        parameters. Raises CollectiveError if a gather failed or timed out."""
        opt = self.opt
        for bucket in buckets:
            pending = self.pending.pop(bucket, None)
            if pending is None:
                continue
            pending.wait(opt.timeout, WHAT)
            layout = opt.layout
            for index in layout.buckets[bucket].params:
                target = self.targets[index]
                if target is not None:
                    start = layout.flat[index]
                    target.copy_(self.gathered[start : start + opt._numel[index]])

    def finish(self) -> None:
        """Wait for every bucket still in flight, in gather order."""
        self.wait([b for b in self.opt.layout.gather_order if b in self.pending])


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def module_buckets(model: nn.Module, bucket_of: dict[int, list[int]]) -> dict[nn.Module, list[int]]:
    """The buckets each module with a forward waits for (see the module docstring), in gather
    order of first use; `bucket_of` maps id(parameter) to its buckets (optimized ones only; a grouped expert tensor
    may span several)."""
    out: dict[nn.Module, list[int]] = {}
    for module in model.modules():
        if not _has_forward(module):
            continue
        found: set[int] = set()
        stack = [module]
        while stack:
            current = stack.pop()
            found.update(b for p in current.parameters(recurse=False) for b in bucket_of.get(id(p), ()))
            stack.extend(child for child in current.children() if not _has_forward(child))
        if found:
            out[module] = sorted(found)
    return out


def unattributed(model: nn.Module, bucket_of: dict[int, list[int]], attributed: dict[nn.Module, list[int]]) -> set[int]:
    """Buckets holding an optimized parameter that no module's hook waits for (they are
    gathered before the step returns)."""
    covered = {b for buckets in attributed.values() for b in buckets}
    return {bucket for buckets in bucket_of.values() for bucket in buckets if bucket not in covered}


class ForwardHooks:
    """The hooks `overlap_param_gather` installs on the model: a forward pre-hook per module
    that uses optimized parameters, and, on the model itself, a forward hook and state-dict
    pre-hooks that wait for everything."""

    def __init__(self, opt: CanzonaOptimizer, model: nn.Module, bucket_of: dict[int, list[int]]) -> None:
        self.buckets = module_buckets(model, bucket_of)
        self.eager = unattributed(model, bucket_of, self.buckets)
        self.handles: list[RemovableHandle] = []
        ref = opt.weak()
        for module, buckets in self.buckets.items():
            self.handles.append(module.register_forward_pre_hook(_waiter(ref, buckets)))
        self.handles.append(model.register_forward_hook(_finisher(ref)))
        self.handles.append(model.register_state_dict_pre_hook(_finisher(ref)))
        self.handles.append(model.register_load_state_dict_pre_hook(_finisher(ref)))

    def remove(self) -> None:
        """Uninstall every hook."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _waiter(ref: Any, buckets: list[int]) -> Any:
    def hook(module: nn.Module, args: Any) -> None:
        opt = ref()
        if opt is not None:
            opt.wait_gather(buckets)

    return hook


def _finisher(ref: Any) -> Any:
    def hook(*args: Any, **kwargs: Any) -> None:
        opt = ref()
        if opt is not None:
            opt.finish_gather()

    return hook
