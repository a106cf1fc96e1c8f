"""The optimizer math on its own (single process)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from canzona.runtime.rules.newton_schulz import newton_schulz
from canzona.runtime.rules.optimizers import (
    Hyperparameters,
    Muon,
    Shampoo,
    Soap,
    adamw_,
    init_matrix_state,
    inverse_root,
    make_rule,
    matrix_update,
    muon_scale,
)
from canzona.schedules.coefficients import NS_COEFFICIENT_SCHEDULES

HP = Hyperparameters(ns_steps=5, block_size=8, precondition_frequency=2, max_precond_dim=100)
CPU = torch.device("cpu")


@pytest.mark.parametrize("shape", [(16, 16), (8, 24), (24, 8)])
def test_newton_schulz_makes_singular_values_near_one(shape: tuple[int, int]) -> None:
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    singular = torch.linalg.svdvals(newton_schulz(grad, 10, HP.ns_schedule))
    assert singular.min() > 0.5 and singular.max() < 1.3


def test_muon_scales() -> None:
    assert muon_scale(64, 16, "spectral") == pytest.approx(0.2 * 8)
    assert muon_scale(64, 16, "shape") == pytest.approx(2.0)
    assert muon_scale(16, 64, "shape") == 1.0
    assert muon_scale(16, 64, "none") == 1.0
    assert muon_scale(16, 64, "unit_rms") == pytest.approx(0.5)
    assert muon_scale(64, 16, "spectral", 1.0) == pytest.approx(8.0)  # Megatron-core's spectral scale
    assert muon_scale(64, 16, "shape", 0.5) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="update_scale_factor"):
        Hyperparameters(update_scale_factor=-1.0).check()


def _plain_newton_schulz(grad: torch.Tensor, triples: list[tuple[float, float, float]]) -> torch.Tensor:
    """fp64, one matrix, written from the formula: X ← aX + (bA + cA²)X with A = XXᵀ on the
    short side, after a Frobenius normalisation."""
    x = grad.double()
    tall = x.size(0) > x.size(1)
    x = (x.T if tall else x) / x.norm()
    for a, b, c in triples:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


@pytest.mark.parametrize(
    "name, steps", [("quintic", 5), ("quintic", 7), ("polar_express", 5), ("polar_express", 10), ("simple", 5)]
)
@pytest.mark.parametrize("shape", [(12, 40), (40, 12)], ids=["wide", "tall"])
def test_each_iteration_uses_its_schedules_coefficients(name: str, steps: int, shape: tuple[int, int]) -> None:
    """Per-iteration coefficients against the formula in fp64, at fp32's agreement; the
    schedules are not interchangeable (each differs from the others by far more)."""
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    triples = list(NS_COEFFICIENT_SCHEDULES[name])
    wanted = [
        triples[i % len(triples)] if name == "quintic" else triples[min(i, len(triples) - 1)] for i in range(steps)
    ]
    exact = _plain_newton_schulz(grad, wanted)
    assert (newton_schulz(grad, steps, name) - exact).abs().max() < 1e-7  # the normalisation's eps: 1e-7 / ‖G‖
    assert (newton_schulz(grad.float(), steps, name).double() - exact).abs().max() < 1e-5
    assert torch.equal(newton_schulz(grad, steps, wanted), newton_schulz(grad, steps, name))  # the same triples, listed
    others = [other for other in NS_COEFFICIENT_SCHEDULES if other != name]
    assert all((newton_schulz(grad, steps, other) - exact).abs().max() > 1e-3 for other in others)


def test_a_coefficient_schedule_is_checked() -> None:
    for bad in ("cubic", (1.0, 2.0), ((1.0, 2.0, 3.0), (1.0, float("nan"), 3.0)), ()):
        with pytest.raises(ValueError, match="ns_coefficients"):
            Hyperparameters(ns_coefficients=bad).check()  # type: ignore[arg-type]
    assert Hyperparameters(ns_steps=3, ns_coefficients=(3.0, -4.0, 2.0)).ns_schedule == ((3.0, -4.0, 2.0),) * 3


def test_muon_first_step_is_scaled_orthogonalised_gradient() -> None:
    grad = torch.randn(12, 20, generator=torch.Generator().manual_seed(1))
    hp = Hyperparameters(ns_steps=5, nesterov=False, update_scale="shape")
    update = Muon(hp).update(Muon(hp).init_state(12, 20, CPU), grad, 1)
    torch.testing.assert_close(update, newton_schulz(grad, 5, hp.ns_schedule))


def test_inverse_root_of_diagonal() -> None:
    root = inverse_root(torch.diag(torch.tensor([16.0, 81.0])), 4, 1e-12)
    torch.testing.assert_close(root, torch.diag(torch.tensor([0.5, 1 / 3])))


def test_row_blocks_update_each_submatrix_and_write_back_rows() -> None:
    grad = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    blocks = [[[0, 2], [4, 6]], [[2, 4], [6, 8]]]  # interleaved like a TP-sharded fc1
    rule = make_rule("muon", HP)
    update = matrix_update(rule, init_matrix_state(rule, (8, 6), blocks, CPU), grad, blocks, 1)
    for block in blocks:
        rows = torch.cat([torch.arange(a, b) for a, b in block])
        alone = rule.update(rule.init_state(4, 6, CPU), grad[rows], 1)
        torch.testing.assert_close(update[rows], alone)


@pytest.mark.parametrize("rule_type", [Muon, Shampoo, Soap])
def test_rules_return_finite_updates_of_the_gradient_shape(rule_type: type) -> None:
    rule = rule_type(HP)
    state = rule.init_state(20, 12, CPU)
    for step in range(1, 5):
        grad = torch.randn(20, 12, generator=torch.Generator().manual_seed(step))
        update = rule.update(state, grad, step)
        assert update.shape == grad.shape and torch.isfinite(update).all()


def test_shampoo_blocks_and_grafting() -> None:
    rule = Shampoo(HP)
    state = rule.init_state(20, 12, CPU)
    assert len(state["blocks"]) == 3 * 2  # blocks of at most 8 x 8
    grad = torch.randn(20, 12, generator=torch.Generator().manual_seed(3))
    hp = HP
    update = Shampoo(Hyperparameters(**{**hp.__dict__, "momentum": 0.0})).update(state, grad, 1)
    assert float(update[:8, :8].square().mean().sqrt()) == pytest.approx(hp.graft_rms, rel=1e-4)


def test_soap_skips_sides_above_max_precond_dim() -> None:
    hp = Hyperparameters(precondition_frequency=3, max_precond_dim=10)
    state = Soap(hp).init_state(20, 8, CPU)
    assert state["L"] is None and state["R"].shape == (8, 8)
    Soap(hp).update(state, torch.randn(20, 8), 1)
    assert state["QL"] is None and state["QR"].shape == (8, 8)


def test_adamw_matches_torch() -> None:
    hp = Hyperparameters(adamw_lr=1e-2, adamw_betas=(0.9, 0.99), adamw_eps=1e-8, adamw_weight_decay=0.1)
    ours = torch.randn(50, generator=torch.Generator().manual_seed(4))
    theirs = torch.nn.Parameter(ours.clone())
    reference = torch.optim.AdamW([theirs], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    exp_avg, exp_avg_sq = torch.zeros(50), torch.zeros(50)
    for step in range(1, 6):
        grad = torch.randn(50, generator=torch.Generator().manual_seed(10 + step))
        adamw_(ours, grad, exp_avg, exp_avg_sq, step, hp)
        theirs.grad = grad
        reference.step()
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-6, atol=1e-7)


def test_hyperparameters_from_schedule_and_unknown_names() -> None:
    class Settings:
        ns_steps, block_size, precondition_frequency, max_precond_dim, ns_coefficients = 7, 64, 5, 99, "quintic"
        ns_method, gram_restart, ns_dtype = "gram", 3, "bf16"

    hp = Hyperparameters(ns_steps=3, ns_dtype="fp32").resolved(Settings())
    assert (hp.ns_steps, hp.block_size, hp.precondition_frequency, hp.max_precond_dim) == (3, 64, 5, 99)
    assert hp.ns_coefficients == "quintic" and hp.ns_schedule == NS_COEFFICIENT_SCHEDULES["quintic"][:3]
    assert (hp.ns_method, hp.gram_restart, hp.ns_dtype) == ("gram", 3, "fp32")  # given ones stand
    assert hp.newton_schulz_run(CPU) == ("fp32", "gram", 3)
    # unresolved: a file's defaults, as for the coefficients
    assert Hyperparameters(ns_method="gram").newton_schulz_run(CPU) == ("fp32", "gram", 2)
    assert Hyperparameters().newton_schulz_run(torch.device("cuda")) == ("bf16", "standard", 2)
    with pytest.raises(ValueError, match="ns_method"):
        Hyperparameters(ns_method="fast").check()
    with pytest.raises(ValueError, match="gram_restart"):
        Hyperparameters(gram_restart=-1).check()
    with pytest.raises(TypeError, match="unknown hyperparameter"):
        Hyperparameters.from_kwargs({"learning_rate": 1.0})
    with pytest.raises(ValueError, match="update_scale"):
        Hyperparameters(update_scale="bogus").check()
    assert math.isfinite(hp.lr)


# --- Newton-Schulz precision and batching (issue: the runtime at hardware speed) ------------


def test_ns_dtype_is_checked_and_resolved_per_device() -> None:
    from canzona.runtime.rules.newton_schulz import resolve_ns_dtype

    with pytest.raises(ValueError, match="ns_dtype must be one of auto, bf16, tf32, fp32"):
        Hyperparameters(ns_dtype="fp8").check()
    assert resolve_ns_dtype("auto", torch.device("cuda")) == "bf16"  # tensor cores
    assert resolve_ns_dtype("auto", CPU) == "fp32"  # bf16 products are slow on CPUs
    assert resolve_ns_dtype("tf32", CPU) == "fp32" and resolve_ns_dtype("tf32", torch.device("cuda")) == "tf32"
    assert resolve_ns_dtype("bf16", CPU) == "bf16"


def _batch(count: int, shape: tuple[int, int], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator) for _ in range(count)]


@pytest.mark.parametrize("rule_name", ["muon", "shampoo", "soap"])
@pytest.mark.parametrize(
    "blocks",
    [None, [[[0, 4]], [[4, 8]], [[8, 12]]], [[[0, 2], [6, 8]], [[2, 6], [8, 12]]]],
    ids=["whole", "contiguous-blocks", "interleaved-blocks"],
)
@pytest.mark.parametrize("stack_limit", [None, 12 * 10], ids=["one-stack", "stacks-of-one"])
def test_batched_updates_equal_single_ones_bit_for_bit(rule_name: str, blocks: Any, stack_limit: int | None) -> None:
    """k matrices updated as one batch (or in stacks of one matrix) give exactly the numbers of
    k separate updates, in fp32, over several steps (momentum and state carried)."""
    from canzona.runtime.rules.optimizers import matrix_update_batch

    rule = make_rule(rule_name, HP)
    shape = (12, 10)
    batched_states = [init_matrix_state(rule, shape, blocks, CPU) for _ in range(3)]
    single_states = [init_matrix_state(rule, shape, blocks, CPU) for _ in range(3)]
    for step in range(1, 4):
        grads = _batch(3, shape, step)
        singles = [matrix_update(rule, state, grad, blocks, step) for state, grad in zip(single_states, grads)]
        scratch = [grad.clone() for grad in grads]
        matrix_update_batch(rule, batched_states, scratch, blocks, [step] * 3, stack_limit)
        for single, batched in zip(singles, scratch):
            assert torch.equal(single, batched)


@pytest.mark.parametrize("shape", [(16, 48), (48, 16)], ids=["wide", "tall"])
def test_bf16_newton_schulz_stays_within_its_measured_error(shape: tuple[int, int]) -> None:
    """bf16 products (fp32 normalisation) against an fp64 run: the orthogonalised matrix is
    within bf16's resolution (2^-8 relative per product, a few products deep), far from fp32's
    agreement (below 1e-5), and still has singular values near one."""
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    exact = newton_schulz(grad, 5, HP.ns_schedule)
    fp32 = newton_schulz(grad.float(), 5, HP.ns_schedule)
    bf16 = newton_schulz(grad.float(), 5, HP.ns_schedule, precision="bf16")
    assert bf16.dtype == torch.float32
    assert (fp32.double() - exact).abs().max() < 1e-5
    assert 1e-4 < (bf16.double() - exact).abs().max() < 3e-2
    singular = torch.linalg.svdvals(bf16)
    assert singular.min() > 0.5 and singular.max() < 1.3
