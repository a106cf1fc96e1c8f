"""The DP parameter gather of one step, bucket by bucket, and its overlap with the next forward.

After the update every rank holds the new values of what it updated in the parameters
themselves. `ParamGather` copies this DP rank's own slices of every bucket from the parameters
into the gather buffer (the bucket buffer's storage, reused in the dtype values travel in: its
gradients are spent by then), launches every bucket's gather
(`canzona.runtime.exchange.buckets.start_bucket_gather`) in the layout's gather order (the
bucket the next forward needs first, first), and writes a bucket's values into the parameters
once it has arrived. Without `overlap_param_gather` the step waits for all of them before it
returns. With it the step returns at once and `ForwardHooks` wait, module by module, for the
buckets holding the parameters a module is about to use (a forward pre-hook), so the next
forward starts while later buckets are still in flight.

Which buckets a module waits for: those of its own parameters and of the parameters of its
submodules that have no `forward` of their own (holders such as a weight container), whose
parameters its forward must be using itself. A module with no parameter to wait for gets no
hook. Everything else that reads the parameters first waits for every bucket: the end of the
model's forward, the model's `state_dict` / `load_state_dict`, the optimizer's next step and
the next backward's first gradient (the gather buffer is the gradient buffer), `state_dict`,
`load_state_dict`, checkpoints and `finish_gather()`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor, nn

from canzona.runtime.exchange.buckets import DpComms, start_bucket_gather
from canzona.runtime.exchange.comm import Pending
from canzona.runtime.plan import RankPlan

WHAT = "the DP gather of updated parameters"


class ParamGather:
    """The gathers of one step; `active[i]`: whether entry i changed (only those are written)."""

    def __init__(self, plan: RankPlan, comms: DpComms, send: Tensor, active: list[bool]) -> None:
        self.plan, self.comms = plan, comms
        wire = plan.wire_dtype  # the bucket buffer's storage, as many `wire` values as it has elements
        self.gathered = send if wire == send.dtype else send.view(wire)[: send.numel()]
        self.active = active
        layout = plan.layout
        for piece in plan.own_pieces:
            if plan.bound[piece.param] is not None and active[piece.param]:
                start = layout.flat[piece.param] + piece.src
                values = plan.value(piece.param).reshape(-1)[piece.src : piece.src + piece.length]
                self.gathered[start : start + piece.length].copy_(values)
        self.pending: dict[int, Pending] = {
            b: start_bucket_gather(plan, comms, self.gathered, b) for b in layout.gather_order
        }

    @property
    def done(self) -> bool:
        """Whether every bucket has arrived and been written."""
        return not self.pending

    def wait(self, buckets: Iterable[int]) -> None:
        """Wait for `buckets` (those not arrived yet) and write their values into the
        parameters. Raises CollectiveError if a gather failed or timed out."""
        plan = self.plan
        for bucket in buckets:
            pending = self.pending.pop(bucket, None)
            if pending is None:
                continue
            pending.wait(self.comms.timeout, WHAT)
            for index in plan.layout.buckets[bucket].params:
                if plan.bound[index] is not None and self.active[index]:
                    start, stop = plan.grad_span(index)
                    plan.value(index).view(-1).copy_(self.gathered[start:stop])


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


class ForwardHooks:
    """The hooks `overlap_param_gather` installs on the model: a forward pre-hook per module
    that uses optimized parameters, and, on the model itself, a forward hook and state-dict
    pre-hooks that wait for everything. `target()` is the object that waits (held weakly by
    the caller: None once it is gone), with `wait_gather(buckets)` and `finish_gather()`."""

    def __init__(self, target: Callable[[], Any], model: nn.Module, bucket_of: dict[int, list[int]]) -> None:
        self.buckets = module_buckets(model, bucket_of)
        covered = {b for buckets in self.buckets.values() for b in buckets}
        # buckets no module's hook waits for: gathered before the step returns
        self.eager = {b for buckets in bucket_of.values() for b in buckets if b not in covered}
        for module, buckets in self.buckets.items():
            module.register_forward_pre_hook(_waiter(target, buckets))
        model.register_forward_hook(_finisher(target))
        model.register_state_dict_pre_hook(_finisher(target))
        model.register_load_state_dict_pre_hook(_finisher(target))


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
