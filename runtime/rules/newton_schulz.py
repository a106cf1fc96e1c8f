"""Muon's Newton–Schulz kernels: the coefficient schedule, the precision the products run in,
and the two iterations, batched by shape.

- **standard**: on the normalised n×m matrix X (n ≤ m), per step A = X·Xᵀ, B = b·A + c·A² and
  X ← a·X + B·X, in fused `baddbmm` form.
- **gram** (Gram Newton–Schulz, Zhang, Amsel, Chen and Dao, 2026): the same polynomial
  iteration carried on the n×n Gram matrix R = X·Xᵀ. Every step's X is Q·X₀ for a polynomial Q
  of R₀, so the loop keeps Q and R (Z = b·R + c·R², Q ← Q·(a + Z), R ← (a + Z)·R·(a + Z)) and
  forms Q·X once at the end: n×n products instead of n×m ones. Low precision lets R drift from
  the true Gram matrix of Q·X₀, so after `restart` steps it restarts: X ← Q·X, R = X·Xᵀ, Q = I.
  A matrix at most `GRAM_MIN_ASPECT` times as long as wide falls back to the standard
  iteration (`canzona.schedules.costs.runs_gram`, the rule the planner prices by).

Same-shape matrices run as one batch, so a batch shares one method. With ns_dtype bf16 on a
Hopper or newer GPU where the `gram-newton-schulz` package is installed (`pip install
'canzona[gram]'`), Gram batches run through its symmetric kernels (fp16 operands); elsewhere
the torch form below runs.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch
from torch import Tensor

from canzona.schedules.coefficients import NS_COEFFICIENT_NAMES, Coefficients, coefficient_steps
from canzona.schedules.costs import ns_precision, runs_gram
from canzona.schedules.limits import DEFAULT_GRAM_RESTART, STANDARD_NS

NsCoefficients = str | Coefficients | tuple[Coefficients, ...]
"""A coefficient schedule as the runtime takes it: a name, one triple for every iteration, or a
sequence of triples, one per iteration (the last repeats past its end)."""


def finite_number(value: Any) -> bool:
    """Whether `value` is a finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _triple(value: Any) -> Coefficients | None:
    if isinstance(value, (tuple, list)) and len(value) == 3 and all(finite_number(c) for c in value):
        return (float(value[0]), float(value[1]), float(value[2]))
    return None


def coefficient_schedule(value: NsCoefficients, steps: int) -> tuple[Coefficients, ...]:
    """The (a, b, c) of each of `steps` iterations that `value` names: a schedule's name (its
    own rule past its end), one triple (every iteration) or a sequence of triples (one per
    iteration, the last repeated). ValueError for anything else."""
    if isinstance(value, str):
        if value not in NS_COEFFICIENT_NAMES:
            raise ValueError(
                f"ns_coefficients must be one of {', '.join(NS_COEFFICIENT_NAMES)}, three numbers or a "
                f"list of such triples, got {value!r}"
            )
        return coefficient_steps(value, steps)
    single = _triple(value)
    if single is not None:
        return (single,) * steps
    read = [_triple(item) for item in value] if isinstance(value, (tuple, list)) else [None]
    triples = [t for t in read if t is not None]
    if not triples or len(triples) != len(read):
        raise ValueError(
            f"ns_coefficients must be a schedule's name, three finite numbers or a list of such triples, got {value!r}"
        )
    return tuple(triples[min(i, len(triples) - 1)] for i in range(steps))


def compute_dtype(tensor: Tensor) -> torch.dtype:
    """The dtype the math runs in for `tensor`: fp32, or fp64 for fp64 input."""
    return torch.promote_types(tensor.dtype, torch.float32)


def resolve_ns_dtype(ns_dtype: str, device: torch.device) -> str:
    """The Newton–Schulz precision `ns_dtype` means on `device` (`ns_precision`, the planner's
    rule: "auto" is "bf16" on CUDA and "fp32" elsewhere; "tf32" is "fp32" off CUDA)."""
    return ns_precision(ns_dtype, device.type == "cuda")


@contextmanager
def matmul_precision(precision: str, device: torch.device) -> Iterator[None]:
    """TF32 products for fp32 matrices inside the block ("tf32" on CUDA), restored after."""
    if precision != "tf32" or device.type != "cuda":
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def standard_iterate(x: Tensor, schedule: Sequence[Coefficients], precision: str) -> Tensor:
    """The standard iteration on normalised matrices `x` [k, m, n], one batched product per
    step, with the (a, b, c) of each step from `schedule`: A = X·Xᵀ (Xᵀ·X for a tall matrix),
    B = b·A + c·A·A and X ← a·X + B·X (X·B) in fused `baddbmm` form. Two buffers of x's size
    alternate; returns the one holding the result."""
    tall = x.size(-2) > x.size(-1)
    spare = torch.empty_like(x)
    with matmul_precision(precision, x.device):
        for a, b, c in schedule:
            gram = torch.bmm(x.mT, x) if tall else torch.bmm(x, x.mT)
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            if tall:
                torch.baddbmm(x, x, poly, beta=a, alpha=1.0, out=spare)
            else:
                torch.baddbmm(x, poly, x, beta=a, alpha=1.0, out=spare)
            x, spare = spare, x
    return x


def gram_iterate(x: Tensor, schedule: Sequence[Coefficients], precision: str, restart: int) -> Tensor:
    """Gram Newton–Schulz on normalised matrices `x` [k, m, n] (module docstring), restarting
    after `restart` steps (0, or at least the step count: never); returns a new tensor."""
    tall = x.size(-2) > x.size(-1)
    wide = x.mT if tall else x  # n x m with n <= m: the Gram matrix is the small side's
    steps = len(schedule)
    with matmul_precision(precision, x.device):
        gram = torch.bmm(wide, wide.mT)
        q: Tensor | None = None
        for step, (a, b, c) in enumerate(schedule):
            if q is not None and step == restart:
                wide = torch.bmm(q, wide)
                gram, q = torch.bmm(wide, wide.mT), None
            z = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # the step's polynomial, less a·I
            if step < steps - 1 and step + 1 != restart:
                rz = torch.baddbmm(gram, gram, z, beta=a)  # R·(a + Z)
                gram = torch.baddbmm(rz, z, rz, beta=a)  # (a + Z)·R·(a + Z)
            if q is None:
                q = z
                q.diagonal(dim1=-2, dim2=-1).add_(a)
            else:
                q = torch.baddbmm(q, q, z, beta=a)
        assert q is not None  # a schedule has at least one step
        out = torch.bmm(q, wide)
    return out.mT if tall else out


@cache
def _gram_kernels_installed() -> bool:
    return importlib.util.find_spec("gram_newton_schulz") is not None


GramKernel = Callable[[Tensor, Sequence[Coefficients], int], Tensor]


@cache
def package_kernel(schedule: tuple[Coefficients, ...], restarts: tuple[int, ...]) -> Callable[[Tensor], Tensor]:
    """The package's Gram iteration for one schedule and restart (one instance per setting:
    its call is compiled, and a new instance would compile again)."""
    from gram_newton_schulz import GramNewtonSchulz

    kernel: Callable[[Tensor], Tensor] = GramNewtonSchulz(
        ns_coefficients=[list(triple) for triple in schedule],
        gram_newton_schulz_reset_iterations=list(restarts),
        ns_use_kernels=True,
    )
    return kernel


def kernel_gram(device: torch.device, precision: str) -> GramKernel | None:
    """The `gram-newton-schulz` package's Gram iteration where it can run here (bf16
    products on a CUDA device of compute capability 9 or newer, the package installed), else
    None."""
    if precision != "bf16" or device.type != "cuda" or not _gram_kernels_installed():
        return None
    if torch.cuda.get_device_capability(device)[0] < 9:
        return None

    def run(x: Tensor, schedule: Sequence[Coefficients], restart: int) -> Tensor:
        restarts = (restart,) if 0 < restart < len(schedule) else ()
        return package_kernel(tuple(schedule), restarts)(x.float()).to(x.dtype)

    return run


def orthogonalize_(
    matrices: Sequence[Tensor],
    steps: int,
    coefficients: NsCoefficients,
    precision: str = "fp32",
    eps: float = 1e-7,
    method: str = STANDARD_NS,
    restart: int = DEFAULT_GRAM_RESTART,
) -> None:
    """Replace each of `matrices` (same shape, fp32 or fp64) by its approximate
    orthogonalisation (`steps` iterations of the `coefficients` schedule, by `method`: standard
    or gram, which falls back by shape), in place. Each is normalised by its Frobenius norm where
    it lies; then all are stacked in the precision the products run in (a resolved `ns_dtype`:
    bf16, tf32 or fp32), iterated as one batch and copied back. The workspace is two stacks (of
    bf16 for bf16 products); Gram's adds a few n×n matrices."""
    if not matrices:
        return
    matrices = list(matrices)
    norms = torch._foreach_norm(matrices)
    torch._foreach_add_(norms, eps)
    torch._foreach_div_(matrices, norms)
    first = matrices[0]
    dtype = torch.bfloat16 if precision == "bf16" else first.dtype
    if len(matrices) == 1 and dtype == first.dtype and first.is_contiguous():
        x = first.unsqueeze(0)  # a lone matrix is iterated where it lies
    else:
        x = torch.empty((len(matrices), *first.shape), dtype=dtype, device=first.device)
        torch._foreach_copy_(list(x.unbind(0)), matrices)
    schedule = coefficient_schedule(coefficients, steps)
    if runs_gram(first.size(-2), first.size(-1), method):
        kernel = kernel_gram(first.device, precision)
        result = kernel(x, schedule, restart) if kernel else gram_iterate(x, schedule, precision, restart)
    else:
        result = standard_iterate(x, schedule, precision)
    if result is not x or x.data_ptr() != first.data_ptr():
        torch._foreach_copy_(matrices, list(result.unbind(0)))


def newton_schulz(
    grad: Tensor,
    steps: int,
    coefficients: NsCoefficients,
    eps: float = 1e-7,
    precision: str = "fp32",
    method: str = STANDARD_NS,
    restart: int = DEFAULT_GRAM_RESTART,
) -> Tensor:
    """`orthogonalize_` of one matrix (the same numbers as inside a batch), in fp32 (fp64 for
    fp64 input); `grad` is left as it is."""
    x = grad.to(compute_dtype(grad), copy=True)
    orthogonalize_([x], steps, coefficients, precision, eps, method, restart)
    return x
