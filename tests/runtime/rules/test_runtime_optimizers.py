"""The optimizer math on its own (single process)."""

from __future__ import annotations

import math

import pytest
import torch

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
    newton_schulz,
)

HP = Hyperparameters(ns_steps=5, block_size=8, precondition_frequency=2, max_precond_dim=100)
CPU = torch.device("cpu")


@pytest.mark.parametrize("shape", [(16, 16), (8, 24), (24, 8)])
def test_newton_schulz_makes_singular_values_near_one(shape: tuple[int, int]) -> None:
    grad = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    singular = torch.linalg.svdvals(newton_schulz(grad, 10, HP.ns_coefficients))
    assert singular.min() > 0.5 and singular.max() < 1.3


def test_muon_scales() -> None:
    assert muon_scale(64, 16, "spectral") == pytest.approx(0.2 * 8)
    assert muon_scale(64, 16, "shape") == pytest.approx(2.0)
    assert muon_scale(16, 64, "shape") == 1.0
    assert muon_scale(16, 64, "none") == 1.0


def test_muon_first_step_is_scaled_orthogonalised_gradient() -> None:
    grad = torch.randn(12, 20, generator=torch.Generator().manual_seed(1))
    hp = Hyperparameters(ns_steps=5, nesterov=False, update_scale="shape")
    update = Muon(hp).update(Muon(hp).init_state(12, 20, CPU), grad, 1)
    torch.testing.assert_close(update, newton_schulz(grad, 5, hp.ns_coefficients))


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
        ns_steps, block_size, precondition_frequency, max_precond_dim = 7, 64, 5, 99

    hp = Hyperparameters(ns_steps=3).resolved(Settings())
    assert (hp.ns_steps, hp.block_size, hp.precondition_frequency, hp.max_precond_dim) == (3, 64, 5, 99)
    with pytest.raises(TypeError, match="unknown hyperparameter"):
        Hyperparameters.from_kwargs({"learning_rate": 1.0})
    with pytest.raises(ValueError, match="update_scale"):
        Hyperparameters(update_scale="bogus").check()
    assert math.isfinite(hp.lr)
