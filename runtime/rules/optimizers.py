"""Pure tensor math of the optimizers: Muon, Shampoo, SOAP (per matrix) and AdamW (per vector).

Shared by the distributed runtime (on the hosts) and the single-process reference, so the oracle
and the runtime evaluate the same formulas; what the reference checks is everything around them
(packing, reduction, ownership, gather/scatter, row blocks). State, momentum, normalisation and
every elementwise step are fp32 (fp64 when given fp64 gradients and state, as the fp64 reference
does), on the device of the tensors given (state is created on the `device`, in the `dtype`, the
caller names).

Muon's Newton–Schulz (`canzona.runtime.rules.newton_schulz`) takes its (a, b, c) per iteration
from a coefficient schedule (`ns_coefficients`: a name of `canzona.schedules.coefficients`, one
triple for every iteration, or one triple per iteration) and runs as the `ns_method` names
(standard, or gram with its `gram_restart`). Its products run in the precision `ns_dtype` names:
"bf16" (bf16 operands, fp32 accumulation: tensor cores), "tf32" (fp32 operands, TF32 tensor-core
products on CUDA; plain fp32 elsewhere) or "fp32"; "auto" is bf16 on CUDA and fp32 on every other
device (bf16 matrix products are slow on CPUs). All three default to the schedule's. Same-shape
matrices are orthogonalised as one batched product (`orthogonalize_`); a single matrix is a
batch of one, so the batched and the per-matrix results are the same numbers. Shampoo's and
SOAP's eigendecompositions, inverse roots and preconditioner products stay in fp32: their
accuracy against fp64 is what the tests measure.

A matrix rule turns the gradient of one (sub)matrix into an update direction `u`; the caller
applies it as ``p ← p·(1 − lr·wd) − lr·u`` (decoupled weight decay).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import torch
from torch import Tensor

from canzona.runtime.rules.newton_schulz import (
    NsCoefficients,
    coefficient_schedule,
    compute_dtype,
    finite_number,
    orthogonalize_,
    resolve_ns_dtype,
)
from canzona.schedules.coefficients import DEFAULT_NS_COEFFICIENTS, Coefficients
from canzona.schedules.limits import DEFAULT_GRAM_RESTART, NS_DTYPES, NS_METHODS, STANDARD_NS
from canzona.schedules.reshard import submatrix_shapes

MATRIX_OPTIMIZERS = ("muon", "shampoo", "soap")
UPDATE_SCALES = ("spectral", "shape", "unit_rms", "none")
SPECTRAL_FACTOR = 0.2  # Moonlight's: the spectral update then has about AdamW's RMS
RowBlock = list[list[int]] | tuple[tuple[int, int], ...]
RowBlocks = list[list[list[int]]]
"""A matrix's row blocks as a schedule lists them (`ParamEntry.row_blocks`): per submatrix, its
[start, stop) row ranges in order."""
State = dict[str, Any]


@dataclass(frozen=True)
class Hyperparameters:
    """Every optimizer knob. `None` settings are taken from the schedule's `request.optimizer`
    (so the runtime executes what the planner costed); AdamW has its own lr, betas and decay."""

    lr: float = 0.02
    weight_decay: float = 0.0
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int | None = None
    ns_coefficients: NsCoefficients | None = None
    ns_dtype: str | None = None
    ns_method: str | None = None
    gram_restart: int | None = None
    update_scale: str = "spectral"
    update_scale_factor: float | None = None
    block_size: int | None = None
    precondition_frequency: int | None = None
    max_precond_dim: int | None = None
    shampoo_beta2: float = 1.0
    graft_rms: float = 0.2
    matrix_eps: float = 1e-6
    soap_betas: tuple[float, float] = (0.95, 0.95)
    soap_shampoo_beta: float = 0.95
    soap_eps: float = 1e-8
    adamw_lr: float = 3e-4
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.0

    def resolved(self, settings: Any) -> Hyperparameters:
        """Fill the `None` settings from a schedule's `OptimizerSettings` and check the rest."""
        filled = replace(
            self,
            **{name: getattr(settings, name) for name in SCHEDULE_SETTINGS if getattr(self, name) is None},
        )
        filled.check()
        return filled

    def check(self) -> None:
        """Raise ValueError naming the first impossible setting."""
        if self.update_scale not in UPDATE_SCALES:
            raise ValueError(f"update_scale must be one of {', '.join(UPDATE_SCALES)}, got {self.update_scale!r}")
        if self.ns_dtype is not None and self.ns_dtype not in NS_DTYPES:
            raise ValueError(f"ns_dtype must be one of {', '.join(NS_DTYPES)}, got {self.ns_dtype!r}")
        if self.ns_method is not None and self.ns_method not in NS_METHODS:
            raise ValueError(f"ns_method must be one of {', '.join(NS_METHODS)}, got {self.ns_method!r}")
        restart = self.gram_restart
        if restart is not None and (isinstance(restart, bool) or not isinstance(restart, int) or restart < 0):
            raise ValueError(f"gram_restart must be an integer >= 0 (0: never), got {restart!r}")
        for name in ("ns_steps", "block_size", "precondition_frequency", "max_precond_dim"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.nesterov, bool):
            raise ValueError(f"nesterov must be True or False, got {self.nesterov!r}")
        for name, low, high, closed in _RANGES:
            _check_range(name, getattr(self, name), low, high, closed)
        for name in ("soap_betas", "adamw_betas"):
            value = getattr(self, name)
            if not isinstance(value, tuple) or len(value) != 2:
                raise ValueError(f"{name} must be two numbers, got {value!r}")
            for index, beta in enumerate(value):
                _check_range(f"{name}[{index}]", beta, 0.0, 1.0, False)
        if self.ns_coefficients is not None:
            coefficient_schedule(self.ns_coefficients, 1)
        if self.update_scale_factor is not None:
            _check_range("update_scale_factor", self.update_scale_factor, 0.0, math.inf, False)

    @property
    def ns_schedule(self) -> tuple[Coefficients, ...]:
        """The (a, b, c) of each of the `ns_steps` Newton–Schulz iterations (after `resolved`;
        unresolved coefficients are the default schedule's, as in a file that records none)."""
        assert self.ns_steps is not None
        return coefficient_schedule(self.ns_coefficients or DEFAULT_NS_COEFFICIENTS, self.ns_steps)

    def newton_schulz_run(self, device: torch.device) -> tuple[str, str, int]:
        """How Muon's Newton–Schulz runs on `device`: the products' precision (`ns_dtype`
        resolved there), the method and the Gram restart; unresolved settings are a file's
        defaults, as `ns_schedule`'s coefficients ("auto", standard, `DEFAULT_GRAM_RESTART`)."""
        restart = DEFAULT_GRAM_RESTART if self.gram_restart is None else self.gram_restart
        return resolve_ns_dtype(self.ns_dtype or "auto", device), self.ns_method or STANDARD_NS, restart

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> Hyperparameters:
        """Build from keyword arguments; TypeError naming any unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown hyperparameter(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**kwargs)


# Settings a schedule records (`request.optimizer`) that a None hyperparameter takes from it.
SCHEDULE_SETTINGS = (
    "ns_steps",
    "block_size",
    "precondition_frequency",
    "max_precond_dim",
    "ns_coefficients",
    "ns_dtype",
    "ns_method",
    "gram_restart",
)

# (name, low, high, high included): every scalar knob must be a finite number in [low, high].
_RANGES = (
    ("lr", 0.0, math.inf, False),
    ("weight_decay", 0.0, math.inf, False),
    ("momentum", 0.0, 1.0, False),
    ("shampoo_beta2", 0.0, 1.0, True),
    ("graft_rms", 0.0, math.inf, False),
    ("matrix_eps", 0.0, math.inf, False),
    ("soap_shampoo_beta", 0.0, 1.0, False),
    ("soap_eps", 0.0, math.inf, False),
    ("adamw_lr", 0.0, math.inf, False),
    ("adamw_eps", 0.0, math.inf, False),
    ("adamw_weight_decay", 0.0, math.inf, False),
)


def _check_range(name: str, value: Any, low: float, high: float, closed: bool) -> None:
    inside = finite_number(value) and low <= value and (value <= high if closed else value < high)
    if not inside:
        bound = f"[{low:g}, {high:g}]" if closed else (f">= {low:g}" if math.isinf(high) else f"in [{low:g}, {high:g})")
        raise ValueError(f"{name} must be {bound}, got {value!r}")


def muon_scale(rows: int, cols: int, mode: str, factor: float | None = None) -> float:
    """The update's scale for an m×n matrix: `factor` times `spectral` √max(m,n), `shape`
    √max(1, m/n), `unit_rms` √(m/n) or `none` 1. `factor` None is the mode's own: 0.2 for
    `spectral` (the update then has about AdamW's RMS), 1 for the others."""
    if factor is None:
        factor = SPECTRAL_FACTOR if mode == "spectral" else 1.0
    if mode == "spectral":
        return factor * math.sqrt(max(rows, cols))
    if mode == "shape":
        return factor * math.sqrt(max(1.0, rows / cols))
    if mode == "unit_rms":
        return factor * math.sqrt(rows / cols)
    return factor


def inverse_root(matrix: Tensor, root: int, eps: float) -> Tensor:
    """matrix^(-1/root) of a symmetric PSD matrix, eigenvalues floored at eps·λ_max."""
    eigenvalues, vectors = torch.linalg.eigh(matrix)
    floor = eps * max(float(eigenvalues.max()), 1e-30)
    powered = eigenvalues.clamp(min=0.0).add(floor).pow(-1.0 / root)
    return (vectors * powered) @ vectors.T


class MatrixRule(Protocol):
    """One matrix optimizer: fresh state for a rows×cols matrix, and one step of it."""

    def init_state(self, rows: int, cols: int, device: torch.device, dtype: torch.dtype = torch.float32) -> State:
        """The state of a new rows×cols matrix, on `device`, in `dtype`."""
        ...

    def update(self, state: State, grad: Tensor, step: int) -> Tensor:
        """The update direction of `grad` (fp32, same shape); `step` counts from 1."""
        ...


def muon_update_(hp: Hyperparameters, momenta: Sequence[Tensor], grads: Sequence[Tensor]) -> None:
    """Muon on k same-shape matrices, in place: each momentum buffer becomes μ·buf + g, and each
    gradient of `grads` (scratch) becomes its update: the direction g + μ·buf (Nesterov) or buf,
    orthogonalised as one batch (`orthogonalize_`, in `hp.ns_dtype` on the tensors' device),
    then scaled."""
    momenta, grads = list(momenta), list(grads)
    torch._foreach_mul_(momenta, hp.momentum)
    torch._foreach_add_(momenta, grads)
    if hp.nesterov:
        torch._foreach_add_(grads, momenta, alpha=hp.momentum)
    else:
        torch._foreach_copy_(grads, momenta)
    precision, method, restart = hp.newton_schulz_run(grads[0].device)
    schedule = hp.ns_schedule
    orthogonalize_(grads, len(schedule), schedule, precision, method=method, restart=restart)
    torch._foreach_mul_(
        grads, muon_scale(grads[0].size(-2), grads[0].size(-1), hp.update_scale, hp.update_scale_factor)
    )


@dataclass(frozen=True)
class Muon:
    """Momentum (optionally Nesterov), Newton–Schulz orthogonalisation, shape-dependent scale."""

    hp: Hyperparameters

    def init_state(self, rows: int, cols: int, device: torch.device, dtype: torch.dtype = torch.float32) -> State:
        """A zero momentum buffer."""
        return {"momentum": torch.zeros(rows, cols, dtype=dtype, device=device)}

    def update(self, state: State, grad: Tensor, step: int) -> Tensor:
        """Moonlight/Megatron form: buf ← μ·buf + g; orthogonalise g + μ·buf (Nesterov) or buf
        (`muon_update_` on a batch of one)."""
        update = grad.to(compute_dtype(grad)).clone()
        muon_update_(self.hp, [state["momentum"]], [update])
        return update


def _spans(size: int, block: int) -> list[tuple[int, int]]:
    return [(start, min(start + block, size)) for start in range(0, size, block)]


@dataclass(frozen=True)
class Shampoo:
    """Blocked Shampoo: per block of at most B×B, L += G·Gᵀ and R += Gᵀ·G (EMA when β2 < 1),
    roots L^-1/4, R^-1/4 refreshed every `precondition_frequency` steps (from step 1), direction
    L^-1/4·G·R^-1/4 grafted to RMS `graft_rms`, then momentum (Nesterov optional)."""

    hp: Hyperparameters

    def init_state(self, rows: int, cols: int, device: torch.device, dtype: torch.dtype = torch.float32) -> State:
        """Zero statistics and identity roots per block, and a momentum buffer."""
        assert self.hp.block_size is not None
        blocks = []
        for r0, r1 in _spans(rows, self.hp.block_size):
            for c0, c1 in _spans(cols, self.hp.block_size):
                m, n = r1 - r0, c1 - c0
                blocks.append(
                    {
                        "L": torch.zeros(m, m, dtype=dtype, device=device),
                        "R": torch.zeros(n, n, dtype=dtype, device=device),
                        "L_root": torch.eye(m, dtype=dtype, device=device),
                        "R_root": torch.eye(n, dtype=dtype, device=device),
                    }
                )
        return {"blocks": blocks, "momentum": torch.zeros(rows, cols, dtype=dtype, device=device)}

    def update(self, state: State, grad: Tensor, step: int) -> Tensor:
        """One Shampoo step on `grad`."""
        hp = self.hp
        assert hp.block_size is not None and hp.precondition_frequency is not None
        refresh = (step - 1) % hp.precondition_frequency == 0
        direction = torch.empty_like(grad)
        spans = [(r, c) for r in _spans(grad.size(0), hp.block_size) for c in _spans(grad.size(1), hp.block_size)]
        for block, ((r0, r1), (c0, c1)) in zip(state["blocks"], spans):
            g = grad[r0:r1, c0:c1]
            block["L"].mul_(hp.shampoo_beta2).add_(g @ g.T)
            block["R"].mul_(hp.shampoo_beta2).add_(g.T @ g)
            if refresh:
                block["L_root"] = inverse_root(block["L"], 4, hp.matrix_eps)
                block["R_root"] = inverse_root(block["R"], 4, hp.matrix_eps)
            pre = block["L_root"] @ g @ block["R_root"]
            rms = pre.square().mean().sqrt()
            direction[r0:r1, c0:c1] = pre * (hp.graft_rms / (float(rms) + 1e-30))
        buf = state["momentum"]
        buf.mul_(hp.momentum).add_(direction)
        return direction.add(buf, alpha=hp.momentum) if hp.nesterov else buf.clone()


@dataclass(frozen=True)
class Soap:
    """SOAP: Adam in the eigenbasis of Shampoo's L and R (sides above `max_precond_dim` keep
    the identity). L, R are EMAs (β = `soap_shampoo_beta`) updated before use; the eigenbasis
    is recomputed (eigh) on step 1 and every `precondition_frequency` steps. The first moment
    lives in the original space and is projected each step; the second in the eigenbasis."""

    hp: Hyperparameters

    def init_state(self, rows: int, cols: int, device: torch.device, dtype: torch.dtype = torch.float32) -> State:
        """Zero moments and statistics; no basis until the first step."""
        limit = self.hp.max_precond_dim
        assert limit is not None
        return {
            "exp_avg": torch.zeros(rows, cols, dtype=dtype, device=device),
            "exp_avg_sq": torch.zeros(rows, cols, dtype=dtype, device=device),
            "L": torch.zeros(rows, rows, dtype=dtype, device=device) if rows <= limit else None,
            "R": torch.zeros(cols, cols, dtype=dtype, device=device) if cols <= limit else None,
            "QL": None,
            "QR": None,
        }

    def update(self, state: State, grad: Tensor, step: int) -> Tensor:
        """One SOAP step on `grad`."""
        hp = self.hp
        beta1, beta2 = hp.soap_betas
        assert hp.precondition_frequency is not None
        for stat, basis, product in (("L", "QL", lambda: grad @ grad.T), ("R", "QR", lambda: grad.T @ grad)):
            if state[stat] is None:
                continue
            state[stat].mul_(hp.soap_shampoo_beta).add_(product(), alpha=1 - hp.soap_shampoo_beta)
            if step == 1 or (step - 1) % hp.precondition_frequency == 0:
                # contiguous: eigh returns column-major vectors, and the matmul kernels (so the
                # rounding) depend on the layout; a checkpoint restores row-major tensors.
                state[basis] = torch.linalg.eigh(state[stat])[1].contiguous()
        state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
        projected = _project(grad, state["QL"], state["QR"])
        state["exp_avg_sq"].mul_(beta2).addcmul_(projected, projected, value=1 - beta2)
        mean = _project(state["exp_avg"], state["QL"], state["QR"]) / (1 - beta1**step)
        denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(hp.soap_eps)
        return _project_back(mean / denom, state["QL"], state["QR"])


def _project(x: Tensor, left: Tensor | None, right: Tensor | None) -> Tensor:
    if left is not None:
        x = left.T @ x
    if right is not None:
        x = x @ right
    return x


def _project_back(x: Tensor, left: Tensor | None, right: Tensor | None) -> Tensor:
    if left is not None:
        x = left @ x
    if right is not None:
        x = x @ right.T
    return x


def make_rule(name: str, hp: Hyperparameters) -> MatrixRule:
    """The matrix rule called `name` (muon, shampoo, soap)."""
    rules: dict[str, Callable[[Hyperparameters], MatrixRule]] = {"muon": Muon, "shampoo": Shampoo, "soap": Soap}
    if name not in rules:
        raise ValueError(f"unknown matrix optimizer {name!r}; expected one of {', '.join(MATRIX_OPTIMIZERS)}")
    return rules[name](hp)


def init_matrix_state(
    rule: MatrixRule,
    shape: tuple[int, int],
    row_blocks: RowBlocks | None,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> list[State]:
    """Fresh state of every submatrix of one matrix, on `device`, in `dtype`."""
    return [rule.init_state(rows, cols, device, dtype) for rows, cols in submatrix_shapes(shape, row_blocks)]


def _rows(grad: Tensor, block: RowBlock) -> Tensor:
    """The rows `block` lists of a matrix, in order: a view for one range, else a new tensor."""
    parts = [grad[start:stop] for start, stop in block]
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def put_rows(out: Tensor, block: RowBlock, values: Tensor) -> None:
    """Write `values` (rows one after the other) into the row ranges `block` of `out`."""
    row = 0
    for start, stop in block:
        out[start:stop] = values[row : row + stop - start]
        row += stop - start


def stack_limit(group_bytes: int) -> int:
    """Elements of the most matrices a host stacks for one batched Newton–Schulz: an eighth of a
    micro-group's capacity (`group_bytes`) of fp32 gradients, so that the workspace (two stacks,
    the Gram products, a submatrix's rows: about five stacks) stays within that capacity."""
    return max(1, group_bytes // 32)


def matrix_update_batch(
    rule: MatrixRule,
    states: Sequence[list[State]],
    grads: Sequence[Tensor],
    row_blocks: RowBlocks | None,
    steps: Sequence[int],
    stack_limit: int | None = None,
) -> None:
    """Update k same-shape matrices with the same row blocks, in place: each of `grads` (fp32 or
    fp64 scratch) becomes its matrix's update; `states[i]` are the i-th matrix's submatrix
    states and `steps[i]` its step (from 1). Muon updates each submatrix position of the
    matrices as one batch (`muon_update_`), at most `stack_limit` elements of matrices at a time
    (the rows of a submatrix are copied out and back when they are not one range); Shampoo and
    SOAP update matrix by matrix."""
    if not isinstance(rule, Muon):
        for state, grad, step in zip(states, grads, steps):
            grad.copy_(matrix_update(rule, state, grad, row_blocks, step))
        return
    per = max(1, stack_limit // grads[0].numel()) if stack_limit and grads else max(1, len(grads))
    for start in range(0, len(grads), per):
        chunk, held = list(grads[start : start + per]), states[start : start + per]
        if not row_blocks:
            muon_update_(rule.hp, [s[0]["momentum"] for s in held], chunk)
            continue
        for position, block in enumerate(row_blocks):  # blocks are disjoint: each result overwrites its own rows
            subs = [_rows(grad, block) for grad in chunk]
            muon_update_(rule.hp, [s[position]["momentum"] for s in held], subs)
            if len(block) > 1:
                for grad, sub in zip(chunk, subs):
                    put_rows(grad, block, sub)


def matrix_update(
    rule: MatrixRule, states: list[State], grad: Tensor, row_blocks: RowBlocks | None, step: int
) -> Tensor:
    """The update of a whole matrix: each submatrix (its rows gathered from `row_blocks`, in
    order) is updated on its own and the result written back to the same rows. Muon goes
    through `matrix_update_batch` as a batch of one (so batched and single updates agree);
    `grad` is left as it is."""
    work = grad.to(compute_dtype(grad))
    if isinstance(rule, Muon):
        update = work.clone()
        matrix_update_batch(rule, [states], [update], row_blocks, [step])
        return update
    if not row_blocks:
        return rule.update(states[0], work, step)
    out = torch.empty_like(work)
    for state, block in zip(states, row_blocks):
        put_rows(out, block, rule.update(state, _rows(work, block), step))
    return out


def apply_update(param: Tensor, update: Tensor, lr: float, weight_decay: float) -> None:
    """p ← p·(1 − lr·wd) − lr·u, in place (param is fp32: a parameter or its fp32 main copy)."""
    if weight_decay:
        param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-lr)


def adamw_(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    step: int,
    hp: Hyperparameters,
    scratch: Tensor | None = None,
) -> None:
    """One AdamW step on fp32 vectors, in place (torch.optim.AdamW's formula). `scratch` (the
    size of `grad`; `grad` itself when the caller no longer needs it) holds the denominator, so
    the step allocates nothing."""
    beta1, beta2 = hp.adamw_betas
    if hp.adamw_weight_decay:
        param.mul_(1 - hp.adamw_lr * hp.adamw_weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = torch.sqrt(exp_avg_sq, out=scratch) if scratch is not None else exp_avg_sq.sqrt()
    denom.div_(math.sqrt(1 - beta2**step)).add_(hp.adamw_eps)
    param.addcdiv_(exp_avg, denom, value=-hp.adamw_lr / (1 - beta1**step))
