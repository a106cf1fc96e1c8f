"""megatron-core, the real package: a live `GPTModel` (examples/megatron_gpt.py, Megatron's local
layer spec, its ColumnParallelLinear / RowParallelLinear at TP 2) planned by `canzona plan --model
py:...`, trained with `CanzonaOptimizer` configured from Megatron's own `OptimizerConfig`
(`canzona.runtime.integrations.megatron`), and compared step by step with Megatron's Muon on the
same gradients (`megatron_oracle.py`: the formula always, megatron-core's `TensorParallelMuon`
where it imports).

Error: max over parameters of max |canzona - reference| / max |reference - initial| after 3
steps, fp32 (Newton-Schulz at Megatron's "highest" matmul precision). Measured
(benchmarks/megatron_parity.py, BENCHMARKS.md): 1.7e-6 to 5.1e-6 against the fp32 formula and
against megatron-core's own Muon; the fp32 formula itself is 1.0e-5 to 1.1e-5 from the same step
in fp64, so two fp32 implementations can differ by about 2e-5 by rounding alone, and the bound is
the issue's 1e-4. The mismatches the mapping exists for (QKV whole, the simple coefficients,
Nesterov, canzona's own 0.2 scale) are 0.2 to 0.8 away."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install -e '.[megatron]')")

from megatron_oracle import megatron_muon_available, run_parity  # noqa: E402

BOUND = 1e-4  # the issue's; measured 1.7e-6 to 5.1e-6, fp32 rounding alone about 2e-5 (module docstring)

@pytest.mark.slow
@pytest.mark.parametrize("tp, dp", [(1, 1), (1, 2), (2, 1), (2, 2)], ids=["tp1-dp1", "tp1-dp2", "tp2-dp1", "tp2-dp2"])
def test_megatrons_default_muon_is_reproduced(tp: int, dp: int, tmp_path: Path) -> None:
    """Megatron's defaults (split QKV per query group, quintic coefficients, no Nesterov, spectral
    scale √max(m, n)), planned with the options `plan_options` names, at each layout."""
    error, where = run_parity(tmp_path, tp, dp, ("--ns-coefficients", "quintic"))
    assert error < BOUND, f"{where}: {error:.3g}"


@pytest.mark.slow
def test_a_plan_with_canzonas_defaults_splits_qkv_as_megatron(tmp_path: Path) -> None:
    """The plan canzona makes by default (no option) splits the live model's QKV per query group;
    with the simple coefficients on Megatron's side too, the runs agree; Nesterov and weight
    decay as Megatron spells them."""
    error, where = run_parity(tmp_path, 2, 2, overrides={"muon_use_nesterov": True, "weight_decay": 0.1,
                                                         "muon_coefficient_type": "simple"})
    assert error < BOUND, f"{where}: {error:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("flags, ours, theirs", [
    (("--ns-coefficients", "quintic", "--split-qkv", "none"), {"muon_split_qkv": False}, {"muon_split_qkv": True}),
    ((), {"muon_coefficient_type": "simple"}, {"muon_coefficient_type": "quintic"}),
], ids=["qkv-whole", "simple-coefficients"])
def test_the_reference_tells_the_mismatches_apart(flags: tuple[str, ...], ours: dict[str, Any], theirs: dict[str, Any],
                                                 tmp_path: Path) -> None:
    """Negative controls: QKV kept whole, or the simple coefficients, against Megatron's default
    is far outside the bound."""
    error, _ = run_parity(tmp_path, 1, 1, flags, overrides=ours, reference_overrides=theirs)
    assert error > 100 * BOUND


@pytest.mark.slow
@pytest.mark.skipif(not megatron_muon_available(), reason="megatron-core's Muon needs emerging_optimizers, which is not on "
                    "the package index")
@pytest.mark.parametrize("tp, dp", [(1, 2), (2, 1)])
def test_megatron_cores_own_muon_is_reproduced(tp: int, dp: int, tmp_path: Path) -> None:
    error, where = run_parity(tmp_path, tp, dp, ("--ns-coefficients", "quintic"), backend="megatron")
    assert error < BOUND, f"{where}: {error:.3g}"
    assert math.isfinite(error)
