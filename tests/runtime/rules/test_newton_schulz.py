"""Muon's Newton–Schulz methods on their own: standard and Gram against the fp64 polar factor
at every precision the runtime offers, against each other, the fallback rule, the restart, and
the FLOPs the planner prices them at (counted on the runtime's own products).

Tolerances are normwise (‖X − P‖ / ‖P‖) against the polar factor P = U·Vᵀ of an SVD in fp64,
after 8 Polar Express iterations (which converge: the fp64 iteration is 4e-15 from P). Measured
on this machine over the shapes below (worst of 4 seeds): fp32 products 2.5e-6 standard and
9.9e-6 Gram; bf16 products 7.3e-3 standard and 3.0e-2 Gram (Gram iterates on X·Xᵀ, whose
rounding the restart resets once). The bounds leave about 2x headroom; tf32 is fp32 off CUDA.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from canzona.runtime.rules.newton_schulz import (
    coefficient_schedule,
    gram_iterate,
    kernel_gram,
    newton_schulz,
    orthogonalize_,
    standard_iterate,
)
from canzona.runtime.rules.optimizers import Hyperparameters, muon_update_
from canzona.schedules.costs import gram_ns_flops, ns_flops, runs_gram, standard_ns_flops

SHAPES = [(64, 256), (256, 64), (96, 512), (48, 144)]  # every one more than twice as long as wide
TOLERANCE = {  # (precision, method) -> normwise distance to the fp64 polar factor
    ("fp64", "standard"): 1e-12,
    ("fp64", "gram"): 1e-12,
    ("fp32", "standard"): 1e-5,
    ("fp32", "gram"): 2e-5,
    ("tf32", "standard"): 1e-5,
    ("tf32", "gram"): 2e-5,
    ("bf16", "standard"): 1.5e-2,
    ("bf16", "gram"): 6e-2,
}


def _polar(grad: torch.Tensor) -> torch.Tensor:
    u, _, vh = torch.linalg.svd(grad.double(), full_matrices=False)
    return u @ vh


def _distance(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x.double() - reference).norm() / reference.norm())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("precision", "method"), list(TOLERANCE))
def test_each_method_reaches_the_polar_factor_within_its_precision(
    shape: tuple[int, int], precision: str, method: str
) -> None:
    for seed in range(2):
        grad = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
        given = grad if precision == "fp64" else grad.float()
        products = "fp32" if precision == "fp64" else precision
        x = newton_schulz(given, 8, "polar_express", precision=products, method=method)
        assert _distance(x, _polar(grad)) < TOLERANCE[(precision, method)], (shape, seed)


@pytest.mark.parametrize("precision", ["fp64", "fp32", "bf16"])
def test_gram_agrees_with_the_standard_iteration_within_the_precisions_noise(precision: str) -> None:
    """In exact arithmetic the two are the same iteration: fp64 agrees to rounding; in fp32 and
    bf16 they differ by no more than each is from the fp64 iteration."""
    for shape in SHAPES:
        grad = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        exact = newton_schulz(grad, 5, "simple", method="standard")
        given, products = (grad, "fp32") if precision == "fp64" else (grad.float(), precision)
        standard = newton_schulz(given, 5, "simple", precision=products, method="standard")
        gram = newton_schulz(given, 5, "simple", precision=products, method="gram")
        noise = {"fp64": 1e-13, "fp32": 2e-5, "bf16": 6e-2}[precision]
        assert _distance(gram, exact) < noise and _distance(standard, exact) < noise
        assert _distance(gram, standard.double()) < 2 * noise


def test_a_matrix_at_most_twice_as_long_as_wide_falls_back_to_the_standard_iteration() -> None:
    for shape, gram in [
        ((64, 64), False),
        ((64, 128), False),
        ((128, 64), False),
        ((64, 129), True),
        ((130, 64), True),
    ]:
        assert runs_gram(*shape, "gram") is gram and not runs_gram(*shape, "standard")
        grad = torch.randn(shape, generator=torch.Generator().manual_seed(2))
        standard = newton_schulz(grad, 5, "simple", method="standard")
        result = newton_schulz(grad, 5, "simple", method="gram")
        assert torch.equal(result, standard) is not gram  # the same products, bit for bit, where it falls back
        assert _distance(result, standard.double()) < 2e-5


def test_the_restart_is_where_it_says() -> None:
    """Never restarting (0) is the same as a restart past the last step; in fp64 any restart
    leaves the result (the iteration is the same), in bf16 it changes the rounding."""
    grad = torch.randn(64, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    never = newton_schulz(grad, 5, "simple", method="gram", restart=0)
    assert torch.equal(never, newton_schulz(grad, 5, "simple", method="gram", restart=5))
    for restart in (1, 2, 4):
        assert _distance(newton_schulz(grad, 5, "simple", method="gram", restart=restart), never) < 1e-13
    low = [newton_schulz(grad.float(), 5, "simple", precision="bf16", method="gram", restart=r) for r in (0, 2)]
    assert not torch.equal(low[0], low[1])


@pytest.mark.parametrize(
    ("shape", "steps", "restart"), [((3, 64, 256), 5, 2), ((2, 256, 64), 5, 2), ((1, 48, 200), 7, 3)]
)
def test_the_planner_prices_the_products_the_runtime_runs(
    shape: tuple[int, int, int], steps: int, restart: int
) -> None:
    """torch's FLOP counter on the runtime's iterations equals `ns_flops`, the cost model's."""
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(4))
    schedule = coefficient_schedule("simple", steps)
    r, c = min(shape[1:]), max(shape[1:])
    for run, expected in (
        (lambda: gram_iterate(x, schedule, "fp32", restart), gram_ns_flops(r, c, steps, restart)),
        (lambda: standard_iterate(x.clone(), schedule, "fp32"), standard_ns_flops(r, c, steps)),
    ):
        with FlopCounterMode(display=False) as counter:
            run()
        assert counter.get_total_flops() == shape[0] * expected
    assert ns_flops(64, 256, 5, "gram", 2) == gram_ns_flops(64, 256, 5, 2) < ns_flops(64, 256, 5)
    assert ns_flops(64, 128, 5, "gram", 2) == ns_flops(64, 128, 5)  # falls back


def test_a_batch_is_the_matrices_one_at_a_time() -> None:
    grads = [torch.randn(48, 200, generator=torch.Generator().manual_seed(seed)) for seed in range(3)]
    batch = [g.clone() for g in grads]
    orthogonalize_(batch, 5, "simple", "fp32", method="gram")
    for grad, batched in zip(grads, batch):
        assert torch.allclose(newton_schulz(grad, 5, "simple", method="gram"), batched, rtol=1e-5, atol=1e-6)


def test_muon_runs_the_method_its_hyperparameters_name() -> None:
    grad = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    results = {}
    for method in ("standard", "gram"):
        hp = Hyperparameters(ns_steps=5, ns_coefficients="simple", ns_method=method, gram_restart=2, ns_dtype="fp32")
        momentum, scratch = torch.zeros_like(grad), grad.clone()
        muon_update_(hp, [momentum], [scratch])
        results[method] = scratch
    expected = newton_schulz(grad + 0.95 * grad, 5, "simple", method="gram") * 0.2 * 16
    torch.testing.assert_close(results["gram"], expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(results["gram"], results["standard"])


def test_thepackage_kernels_are_used_only_where_they_run() -> None:
    cpu = torch.device("cpu")
    assert kernel_gram(cpu, "bf16") is None and kernel_gram(cpu, "fp32") is None


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("method", ["standard", "gram"])
def test_on_cuda_bf16_each_method_reaches_the_polar_factor(method: str) -> None:
    """The runtime's default precision on a GPU (bf16), by method (the package's kernels where
    installed on Hopper or newer, else the torch form), within the bf16 tolerance above."""
    for shape in SHAPES:
        grad = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        x = newton_schulz(grad.float().cuda(), 8, "polar_express", precision="bf16", method=method)
        assert x.device.type == "cuda"
        assert _distance(x.cpu(), _polar(grad)) < TOLERANCE[("bf16", method)], shape


@pytest.mark.gpu
@needs_cuda
def test_thepackage_kernels_agree_with_the_torch_gram_iteration() -> None:
    device = torch.device("cuda")
    kernel = kernel_gram(device, "bf16")
    if kernel is None:
        pytest.skip("gram-newton-schulz is not installed, or this GPU is older than Hopper")
    schedule = coefficient_schedule("simple", 5)
    x = torch.randn(4, 256, 1024, device=device)
    x /= x.norm(dim=(-2, -1), keepdim=True)
    ours = gram_iterate(x.bfloat16(), schedule, "bf16", 2).double()
    theirs = kernel(x.bfloat16(), schedule, 2).double()
    assert float((ours - theirs).norm() / theirs.norm()) < TOLERANCE[("bf16", "gram")]


def test_thepackage_kernel_is_built_once_per_setting_with_its_documented_arguments(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The adapter hands `gram_newton_schulz.GramNewtonSchulz` the schedule's triples and the
    restart (its `gram_newton_schulz_reset_iterations`), with kernels on; its compiled call
    is kept per setting (a stand-in module: the package needs a Hopper GPU)."""
    import sys
    import types

    from canzona.runtime.rules import newton_schulz as ns

    built: list[dict[str, object]] = []

    class Stand:
        def __init__(self, **kwargs: object) -> None:
            built.append(kwargs)

        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    monkeypatch.setitem(sys.modules, "gram_newton_schulz", types.SimpleNamespace(GramNewtonSchulz=Stand))
    ns.package_kernel.cache_clear()
    schedule = coefficient_schedule("simple", 5)
    first = ns.package_kernel(tuple(schedule), (2,))
    assert first is ns.package_kernel(tuple(schedule), (2,)) and len(built) == 1
    assert built[0] == {
        "ns_coefficients": [list(t) for t in schedule],
        "gram_newton_schulz_reset_iterations": [2],
        "ns_use_kernels": True,
    }
    assert torch.equal(first(torch.ones(2)), torch.full((2,), 2.0))
    ns.package_kernel.cache_clear()
