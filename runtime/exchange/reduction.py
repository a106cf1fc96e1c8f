"""One round of the DP gradient reduction: every bucket reduced once, in a fixed order, in place
in the bucket buffer.

A round packs each optimized entry's gradient (cast to fp32) at its position in the bucket
buffer and launches each bucket's reduction (`canzona.runtime.exchange.buckets`) in the layout's
reduction order. It is filled one of two ways:

- from backward (`overlap_grad_reduce`): a post-accumulate-grad hook says a parameter's
  gradient is final, and the round packs it when the next parameter's hook fires (or backward
  ends): by then every hook of the first parameter has run, whatever order they were
  registered in (transformers registers the hook that sums q_norm's gradient over TP at the
  first forward, after the optimizer's). A bucket is launched once all its parameters are
  packed and every bucket before it in the order has been launched. At the end of that backward
  (an autograd final callback) the round packs whatever backward did not produce (from the
  gradient attribute as it is, zeros where there is none) and launches the rest;
- at the step (overlap off, gradients assigned by hand): every entry packed, then, after the
  step's safe point, every bucket launched.

Backward-time reduction must never change a result, so a round remembers what it packed: the
gradient tensor (weakly) or that there was none, the tensor's in-place version counter, and a
fingerprint of its values (sum and 2-norm, on the device). At the step, `changes` compares them
with what each gradient attribute holds then (`.grad` edited in place by clipping or a loss
scaler, replaced, set to None on some ranks, summed over TP by a hook that ran after canzona's):
the buckets of every changed entry are reduced again (`redo`), once every rank agrees which.
The version counter catches every in-place edit of the tensor, even one that keeps its sum and
norm (rows swapped); the fingerprint catches edits that bump no counter of the tensor itself
(a DTensor gradient's local tensor edited, foreach ops on DTensors).

Either way every rank issues the same collectives in the same order, whatever the timing of its
hooks, so the DP group never desynchronises. A rank-local problem while packing (a gradient of
the wrong shape or device, a non-finite one with `check_finite`) packs zeros, is recorded and is
reported at the step's safe point, where every rank fails together.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from canzona.runtime import binding
from canzona.runtime.exchange.buckets import DpComms, start_bucket_reduce
from canzona.runtime.exchange.comm import Pending
from canzona.runtime.faults import CollectiveError, first_line
from canzona.runtime.plan import RankPlan

WHAT = "the DP reduction of gradients"


@dataclass(frozen=True)
class GradSource:
    """Where gradients are read (`grad`, or Megatron's `main_grad`) and whether a non-finite
    one fails the step."""

    attr: str = "grad"
    check_finite: bool = False


def _fingerprint(flat: Tensor) -> Tensor:
    """Sum and 2-norm of a gradient (accumulated in fp32), on its device, with no host
    synchronisation. Always taken of the gradient tensor itself, so an unchanged gradient gives
    the same bits again."""
    return torch.stack((flat.sum(dtype=torch.float32), torch.linalg.vector_norm(flat, dtype=torch.float32)))


def _version(tensor: Tensor) -> int:
    """torch's in-place version counter of `tensor` (the one autograd checks saved tensors
    with): every in-place operation bumps it, so an edit that keeps the values' sum and norm
    (rows swapped) still shows."""
    return int(tensor._version)


class Round:
    """One reduction of every bucket into `send`. `launching`: launch buckets as soon as they
    are full (backward); otherwise nothing is launched before `launch_rest`."""

    def __init__(self, plan: RankPlan, comms: DpComms, send: Tensor, source: GradSource, launching: bool) -> None:
        self.plan, self.comms, self.send, self.source = plan, comms, send, source
        self.launching = launching
        count = len(plan.names)
        self.missing = [0] * len(plan.layout.buckets)  # parameters of each bucket not packed yet
        for index in plan.managed:
            self.missing[plan.layout.bucket_of[index]] += 1
        self.packed = [False] * count
        self.has_grad = [False] * count
        self.referents: list[Callable[[], Tensor | None] | None] = [
            None
        ] * count  # the gradient each entry was packed from
        self.packed_none = [False] * count  # packed from no gradient (zeros)
        self.versions: list[int | None] = [None] * count  # the packed gradient's in-place version counter
        self.fingerprints = torch.zeros(count, 2, dtype=torch.float32, device=plan.device)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=plan.device)
        self.launched = 0  # buckets launched so far, in reduction order
        self.pending: list[Pending] = []
        self.problem: str | None = None
        self.stale: set[int] = set()  # buckets whose gradients arrived again after their launch
        self.failure: CollectiveError | None = None
        self.closed = False  # the backward that filled it has ended
        self.early = 0  # buckets launched by backward's own hooks (the rest at its end or the step)
        self.waiting: list[int] = []  # arrived, packed once the next parameter's hook fires

    def fail(self, problem: str) -> None:
        """Record the first rank-local problem of the round."""
        self.problem = self.problem or problem

    # -- reading and packing -----------------------------------------------------------------

    def current(self, index: int) -> Tensor | None:
        """The gradient attribute of entry `index`'s model tensor as it is now (not checked)."""
        bound = self.plan.bound[index]
        assert bound is not None
        return getattr(bound.param, self.source.attr, None)

    def read(self, index: int, grad: Tensor | None) -> Tensor | None:
        """Entry `index`'s part of the attribute value `grad`, flattened (None: none); ValueError
        naming what is wrong with it. With `check_finite`, a non-finite value is noted on the
        device (reported at the safe point, without a synchronisation here)."""
        plan, name = self.plan, self.plan.names[index]
        bound = plan.bound[index]
        assert bound is not None
        if grad is None:
            if not hasattr(bound.param, self.source.attr):
                raise ValueError(f"grad_attr {self.source.attr!r}: no such attribute on {name}")
            return None
        local = binding.local_grad(bound, grad)
        if tuple(local.shape) != tuple(bound.value.shape):
            raise ValueError(
                f"the gradient of {name} has shape {list(local.shape)}, the parameter {list(bound.value.shape)}"
            )
        if local.device != plan.device:
            raise ValueError(f"the gradient of {name} is on {local.device}, the parameter on {plan.device}")
        if not local.is_floating_point():
            raise ValueError(f"the gradient of {name} has dtype {local.dtype}, not a floating-point one")
        if self.source.check_finite:
            self.nonfinite |= ~torch.isfinite(local).all()
        return local.detach().reshape(-1)

    def _pack(self, index: int) -> None:
        start, stop = self.plan.grad_span(index)
        target = self.send[start:stop]
        grad, flat = self.current(index), None
        try:
            flat = self.read(index, grad)
        except Exception as error:
            self.fail(
                str(error)
                if isinstance(error, ValueError)
                else f"packing the gradient of {self.plan.names[index]}: {first_line(error)}"
            )
        if flat is None:
            target.zero_()
        else:
            target.copy_(flat)
            if self.launching:  # packed during backward: the step checks whether it changed since
                self.fingerprints[index] = _fingerprint(flat)
        self.referents[index] = (lambda: None) if grad is None else weakref.ref(grad)
        self.packed_none[index] = grad is None
        self.versions[index] = None if grad is None else _version(grad)
        if not self.packed[index]:
            self.missing[self.plan.layout.bucket_of[index]] -= 1
        self.packed[index] = True
        self.has_grad[index] = flat is not None

    def arrive(self, indices: Sequence[int]) -> None:
        """The entries `indices` (one model tensor's) have their final gradient for this round:
        pack those that arrived before them (their hooks have all run by now) and launch what is
        ready; these wait for the next arrival or the end of backward. Never raises: problems
        are recorded for the safe point."""
        self.flush()
        self.waiting = list(indices)

    def flush(self) -> None:
        """Pack the entries waiting to be packed and launch what is ready."""
        waiting, self.waiting = self.waiting, []
        for index in waiting:
            bucket = self.plan.layout.bucket_of[index]
            if self.packed[index] and self._is_launched(bucket):
                self.stale.add(bucket)
                continue
            self._pack(index)
        self._launch_ready()

    def nonfinite_problem(self) -> str | None:
        """Which gradient is non-finite, if this rank noted one (a failure path: synchronises)."""
        if not bool(self.nonfinite):
            return None
        for index in self.plan.managed:
            grad, bound = self.current(index), self.plan.bound[index]
            assert bound is not None
            if grad is not None and not bool(torch.isfinite(binding.local_grad(bound, grad)).all()):
                return f"non-finite gradient in {self.plan.names[index]}"
        return "non-finite gradient"

    def pack_rest(self) -> None:
        """Pack every parameter not packed yet, from its gradient attribute as it is now."""
        for index in self.plan.managed:
            if not self.packed[index]:
                self._pack(index)

    # -- launching and waiting ---------------------------------------------------------------

    def _is_launched(self, bucket: int) -> bool:
        return self.plan.layout.reduce_position[bucket] < self.launched

    def _launch(self, bucket: int) -> None:
        if self.failure is not None:
            return
        try:
            self.pending.append(start_bucket_reduce(self.plan, self.comms, self.send, bucket))
        except Exception as error:
            self.failure = CollectiveError(
                f"canzona: launching {WHAT} failed ({first_line(error)}); restart from the last checkpoint"
            )

    def _launch_ready(self) -> None:
        order = self.plan.layout.reduce_order
        while self.launching and self.launched < len(order) and self.missing[order[self.launched]] == 0:
            self.launched += 1
            self._launch(order[self.launched - 1])

    def launch_rest(self) -> None:
        """Pack what is missing and launch every bucket not launched yet, in order."""
        self.flush()
        self.pack_rest()
        self.launching = True
        self._launch_ready()

    def close(self) -> None:
        """The end of the backward that filled the round: launch the rest (never raises)."""
        self.closed = True
        self.early = self.launched
        self.launch_rest()

    def wait(self) -> None:
        """Wait for every bucket launched; this rank's slices of `send` then hold the DP mean.
        Raises CollectiveError if a collective failed or timed out."""
        pending, self.pending = self.pending, []
        if self.failure is not None:
            raise self.failure
        for item in pending:
            item.wait(self.comms.timeout, WHAT)

    def drain(self) -> None:
        """Finish the round: launch the rest (so every rank issues the same collectives) and
        wait for it. Raises CollectiveError as `wait` does."""
        self.launch_rest()
        self.wait()

    # -- after backward: what changed --------------------------------------------------------

    def changes(self) -> Tensor:
        """Per bucket, 1 where an entry's gradient attribute no longer holds what was packed
        (another tensor, None, or other values), on the device; also re-reads and checks every
        such gradient (problems recorded) and updates `has_grad` to what the step will pack."""
        plan = self.plan
        replaced = set(self.stale)  # buckets known to have changed without looking at values
        prints: list[Tensor] = []  # the fingerprint now of each entry still holding the packed tensor
        entries: list[int] = []
        for index in plan.managed:
            grad, referent = self.current(index), self.referents[index]
            try:
                flat = self.read(index, grad)
            except Exception as error:
                self.fail(str(error) if isinstance(error, ValueError) else first_line(error))
                flat = None
            self.has_grad[index] = flat is not None
            if self._replaced(index, grad, referent):
                replaced.add(plan.layout.bucket_of[index])
            elif flat is not None:  # the same tensor, never edited in place: a fingerprint guards its local part
                prints.append(_fingerprint(flat))
                entries.append(index)
        flags = torch.zeros(len(plan.layout.buckets), dtype=torch.int32, device=plan.device)
        if replaced:
            flags[torch.tensor(sorted(replaced), dtype=torch.int64, device=plan.device)] = 1
        if prints:
            rows = torch.tensor(entries, dtype=torch.int64, device=plan.device)
            differs = (torch.stack(prints) != self.fingerprints[rows]).any(dim=1)
            where = torch.tensor([plan.layout.bucket_of[i] for i in entries], dtype=torch.int64, device=plan.device)
            flags.index_add_(0, where, differs.to(torch.int32))
        return flags.clamp_(max=1)

    def _replaced(self, index: int, grad: Tensor | None, referent: Callable[[], Tensor | None] | None) -> bool:
        """Whether entry `index`'s gradient attribute no longer holds what was packed: set to
        None or from None, another tensor, or the same tensor edited in place."""
        if referent is None:
            return True
        if grad is None or self.packed_none[index]:
            return (grad is None) != self.packed_none[index]
        return referent() is not grad or _version(grad) != self.versions[index]

    def redo(self, buckets: Iterable[int]) -> None:
        """Pack again every entry of `buckets` from its gradient attribute and reduce those
        buckets again, in reduction order (every rank calls it with the same buckets)."""
        chosen = set(buckets)
        layout = self.plan.layout
        for bucket in (b for b in layout.reduce_order if b in chosen):
            for index in layout.buckets[bucket].params:
                if self.plan.bound[index] is not None:
                    self._pack(index)
            self._launch(bucket)
        self.wait()
