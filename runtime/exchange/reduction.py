"""One round of the DP gradient reduction: every bucket reduced once, in a fixed order.

A round packs each parameter's gradient (cast to fp32) into the bucket buffer and launches each
bucket's reduction (`canzona.runtime.exchange.comm.start_reduce`) in the layout's reduction order. It is
filled one of two ways:

- from backward (`overlap_grad_reduce`): a post-accumulate-grad hook packs a parameter as soon
  as backward has its gradient, and a bucket is launched once all its parameters are packed and
  every bucket before it in the order has been launched. At the end of that backward (an
  autograd final callback) the round packs whatever backward did not produce (from the
  gradient attribute as it is, zeros where there is none) and launches the rest;
- at the step (overlap off, gradients assigned by hand, or a round that must be redone): every
  parameter packed, then every bucket launched.

Either way every rank issues the same collectives in the same order, whatever the timing of its
hooks, so the DP group never desynchronises. A rank-local problem while packing (a gradient of
the wrong shape, a non-finite one with `check_finite`) packs zeros, is recorded and is reported
at the step's safe point, where every rank fails together.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.autograd import Variable
from torch.utils.hooks import RemovableHandle

from canzona.runtime import binding
from canzona.runtime.exchange.comm import Pending
from canzona.runtime.faults import CollectiveError

if TYPE_CHECKING:
    from canzona.runtime.optimizer import CanzonaOptimizer

WHAT = "the DP reduction of gradients"


def _line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


class Round:
    """One reduction of every bucket. `launching`: launch buckets as soon as they are full
    (backward); otherwise nothing is launched before `launch_rest`."""

    def __init__(self, opt: CanzonaOptimizer, launching: bool) -> None:
        self.opt = opt
        self.launching = launching
        layout = opt.layout
        self.missing = [0] * len(layout.buckets)  # parameters of each bucket not packed yet
        for index in opt._managed_indices:
            self.missing[layout.bucket_of[index]] += 1
        self.packed = [False] * len(opt.names)
        self.has_grad = [False] * len(opt.names)
        self.launched = 0  # buckets launched so far, in reduction order
        self.pending: list[Pending] = []
        self.grads = torch.empty(opt._size, dtype=torch.float32, device=opt.device)
        self.problem: str | None = None
        self.stale = False  # a gradient changed after its bucket was launched: redo at the step
        self.failure: CollectiveError | None = None
        self.closed = False  # the backward that filled it has ended
        self.early = 0  # buckets launched by backward's own hooks (the rest at its end or the step)

    def fail(self, problem: str) -> None:
        """Record the first rank-local problem of the round."""
        self.problem = self.problem or problem

    def arrive(self, index: int) -> None:
        """Pack parameter `index` (its gradient is final for this round) and launch what is
        ready. Never raises: problems are recorded for the safe point."""
        bucket = self.opt.layout.bucket_of[index]
        if self.packed[index] and self._is_launched(bucket):
            self.stale = True
            return
        self._pack(index)
        self._launch_ready()

    def _is_launched(self, bucket: int) -> bool:
        return self.opt.layout.reduce_position[bucket] < self.launched

    def _pack(self, index: int) -> None:
        opt = self.opt
        start, count = opt.layout.flat[index], opt._numel[index]
        target = opt._send[start : start + count]
        grad = None
        try:
            grad = self._gradient(index)
            if grad is not None:
                target.copy_(grad)
        except Exception as error:  # noqa: BLE001 - reported to every rank at the safe point
            self.fail(str(error) if isinstance(error, ValueError) else f"packing the gradient of {opt.names[index]}: {_line(error)}")
            grad = None
        if grad is None:
            target.zero_()
        if not self.packed[index]:
            self.missing[opt.layout.bucket_of[index]] -= 1
        self.packed[index] = True
        self.has_grad[index] = grad is not None

    def _gradient(self, index: int) -> Tensor | None:
        """This rank's gradient of parameter `index`, flattened (None: it has none); a problem
        with it raises ValueError."""
        opt = self.opt
        param, bound = opt._param(index), opt._bound[index]
        assert bound is not None
        if not hasattr(bound.param, opt.grad_attr):
            raise ValueError(f"grad_attr {opt.grad_attr!r}: no such attribute on {opt.names[index]}")
        grad = binding.local_grad(bound, getattr(bound.param, opt.grad_attr))
        if grad is None:
            return None
        if tuple(grad.shape) != tuple(param.shape):
            raise ValueError(f"the gradient of {opt.names[index]} has shape {list(grad.shape)}, the parameter {list(param.shape)}")
        if opt.check_finite and not bool(torch.isfinite(grad).all()):
            raise ValueError(f"non-finite gradient in {opt.names[index]}")
        return grad.detach().reshape(-1)

    def pack_rest(self) -> None:
        """Pack every parameter not packed yet, from its gradient attribute as it is now."""
        for index in self.opt._managed_indices:
            if not self.packed[index]:
                self._pack(index)

    def _launch_ready(self) -> None:
        order = self.opt.layout.reduce_order
        while self.launching and self.launched < len(order) and self.missing[order[self.launched]] == 0:
            bucket = order[self.launched]
            self.launched += 1
            if self.failure is not None:
                continue
            try:
                self.pending.append(self.opt._start_reduce(bucket, self.grads))
            except Exception as error:  # noqa: BLE001 - a broken group: raised at the step
                self.failure = CollectiveError(f"canzona: launching {WHAT} failed ({_line(error)}); "
                                               "restart from the last checkpoint")

    def launch_rest(self) -> None:
        """Pack what is missing and launch every bucket not launched yet, in order."""
        self.pack_rest()
        self.launching = True
        self._launch_ready()

    def close(self) -> None:
        """The end of the backward that filled the round: launch the rest (never raises)."""
        self.closed = True
        self.early = self.launched
        self.launch_rest()

    def wait(self) -> Tensor:
        """Wait for every bucket and return this rank's DP-mean gradients (region coordinates).
        Raises CollectiveError if a collective failed or timed out."""
        assert self.launched == len(self.opt.layout.reduce_order), "wait() before every bucket was launched"
        pending, self.pending = self.pending, []
        if self.failure is not None:
            raise self.failure
        for item in pending:
            item.wait(self.opt.timeout, WHAT)
        return self.grads

    def drain(self) -> None:
        """Finish a round nobody will use: launch the rest (so every rank issues the same
        collectives) and wait for it. Raises CollectiveError as `wait` does."""
        self.launch_rest()
        self.wait()


def install_grad_hooks(opt: CanzonaOptimizer) -> list[RemovableHandle]:
    """A post-accumulate-grad hook on every optimized model parameter: its gradient is final
    (for each schedule entry it holds: a grouped expert tensor holds several)."""
    ref = opt.weak()
    return [opt._model_param(indices[0]).register_post_accumulate_grad_hook(_on_grad(ref, indices))
            for indices in opt._indices_of_tensor.values()]


def _on_grad(ref: Any, indices: list[int]) -> Any:
    def hook(param: Tensor) -> None:
        opt = ref()
        if opt is not None:
            for index in indices:
                arrived(opt, index)

    return hook


def arrived(opt: CanzonaOptimizer, index: int) -> None:
    """Parameter `index` has its gradient for this backward. Inside `no_sync()` nothing is
    launched (a round already launched is marked stale: its gradients changed, so the step
    redoes it). After `clip_grad_norm_` / `reduce_gradients` nothing is launched either: the
    coming step uses that reduction, as it would without overlap. Otherwise the first gradient
    of a backward opens a round (finishing one an earlier backward left unstepped), whose
    end-of-backward callback launches whatever backward did not produce."""
    current = opt._round
    if not opt._syncing or opt._reduced is not None:
        if current is not None:
            current.stale = True
        return
    if current is None or current.closed:
        opt._round = opened = Round(opt, launching=True)
        if current is not None:
            try:
                current.drain()
            except CollectiveError as error:
                opened.failure = error
        if torch._C._current_graph_task_id() != -1:  # inside backward: close the round at its end
            Variable._execution_engine.queue_callback(opened.close)
        current = opened
    current.arrive(index)
