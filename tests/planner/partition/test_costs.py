"""Cost models: hand-computed values of every formula, and the error paths."""

from __future__ import annotations

import dataclasses

import pytest

from canzona.planner.partition.costs import (
    FlopsCost,
    NumelCost,
    OptimizerConfig,
    adamw_slice_bytes_per_element,
    make_cost_model,
    matrix_state_bytes,
    muon_flops,
    param_cost,
    param_state_bytes,
    shampoo_flops,
    soap_flops,
)
from canzona.planner.spec import ADAMW, MATRIX, ParamSpec, PlanError

# ---------------------------------------------------------------------------------------------
# Muon: T·(4r²c + 2r³) + 10mn, r = min, c = max


def test_muon_small_matrix_by_hand() -> None:
    # r=3, c=5: 4·9·5 = 180, 2·27 = 54 → 234 per step; ×5 steps = 1170; + 10·15 = 150.
    assert muon_flops(3, 5, 5) == 1320.0
    assert muon_flops(5, 3, 5) == 1320.0  # r and c are min / max, not rows / cols


def test_muon_includes_the_2r3_term() -> None:
    # Square 4×4, one step: 4·16·4 = 256, 2·64 = 128 → 384; + 10·16 = 160 → 544.
    assert muon_flops(4, 4, 1) == 544.0
    # Without the 2r³ term (the authors' code) it would be 416.
    assert muon_flops(4, 4, 1) - 416.0 == 128.0


def test_muon_realistic_shape_by_hand() -> None:
    # 1024 × 4096, 5 steps: 4·1024²·4096 = 17_179_869_184; 2·1024³ = 2_147_483_648;
    # sum 19_327_352_832 × 5 = 96_636_764_160; + 10·4_194_304 = 41_943_040.
    assert muon_flops(1024, 4096, 5) == 96_678_707_200.0


def test_flops_cost_uses_muon_settings() -> None:
    model = FlopsCost(OptimizerConfig("muon", ns_steps=2))
    # r=3, c=5: 234 per step × 2 = 468; + 150.
    assert model.matrix_cost(3, 5) == 618.0
    assert model.matrix_cost(5, 3) == 618.0


# ---------------------------------------------------------------------------------------------
# Shampoo, block size B: per bm×bn block 4·bm·bn·(bm+bn) + 11·(bm³+bn³)/f, + 10mn


def test_shampoo_with_edge_blocks_by_hand() -> None:
    # 5 × 3 with B = 2, f = 4: row blocks 2, 2, 1; column blocks 2, 1.
    # (2,2) ×2: 4·2·2·4 = 64 + 11·16/4 = 44 → 108, ×2 = 216
    # (2,1) ×2: 4·2·1·3 = 24 + 11·9/4 = 24.75 → 48.75, ×2 = 97.5
    # (1,2) ×1: 24 + 24.75 = 48.75
    # (1,1) ×1: 4·1·1·2 = 8 + 11·2/4 = 5.5 → 13.5
    # blocks 375.75 + elementwise 150 = 525.75
    assert shampoo_flops(5, 3, 2, 4) == pytest.approx(525.75, rel=1e-12)
    model = FlopsCost(OptimizerConfig("shampoo", block_size=2, precondition_frequency=4))
    assert model.matrix_cost(5, 3) == pytest.approx(525.75, rel=1e-12)


def test_shampoo_one_edge_block_when_smaller_than_block() -> None:
    # 3 × 5 with B = 1024, f = 10: a single 3×5 block.
    # 4·3·5·8 = 480; 11·(27 + 125)/10 = 167.2; + 150 → 797.2
    assert shampoo_flops(3, 5, 1024, 10) == pytest.approx(797.2, rel=1e-12)


def test_shampoo_exact_multiple_has_no_edge_block() -> None:
    # 4 × 4 with B = 2, f = 1: four 2×2 blocks, each 4·2·2·4 = 64 + 11·16 = 176 → 240.
    assert shampoo_flops(4, 4, 2, 1) == pytest.approx(4 * 240 + 160, rel=1e-12)


def test_shampoo_realistic_edge_block_by_hand() -> None:
    # 2500 × 1024, B = 1024, f = 10: two 1024×1024 blocks and one 452×1024 edge block.
    # 1024×1024: 4·1024²·2048 = 8_589_934_592 + 11·2·1024³/10 = 2_362_232_012.8
    # 452×1024: 4·452·1024·1476 = 2_732_654_592 + 11·(452³ + 1024³)/10 = 1_282_695_955.2
    # blocks: 2·10_952_166_604.8 + 4_015_350_547.2 = 25_919_683_756.8; + 10·2_560_000
    assert shampoo_flops(2500, 1024, 1024, 10) == pytest.approx(25_945_283_756.8, rel=1e-12)


def test_shampoo_blocking_matches_an_independent_block_walk() -> None:
    for rows, cols, block, freq in [(7, 3, 2, 3), (1, 9, 4, 1), (10, 10, 3, 7), (6, 13, 13, 2)]:
        expected = 0.0
        for r0 in range(0, rows, block):
            for c0 in range(0, cols, block):
                bm, bn = min(block, rows - r0), min(block, cols - c0)
                expected += 4 * bm * bn * (bm + bn) + 11 * (bm**3 + bn**3) / freq
        expected += 10 * rows * cols
        assert shampoo_flops(rows, cols, block, freq) == pytest.approx(expected, rel=1e-12)


# ---------------------------------------------------------------------------------------------
# SOAP: per side s ≤ k: 6·mn·s + (22/3)·s³/f, + 10mn


def test_soap_both_sides_preconditioned_by_hand() -> None:
    # 3 × 5, f = 2, k = 10: elementwise 150;
    # side 3: 6·15·3 = 270 + (22/3)·27/2 = 99 → 369
    # side 5: 6·15·5 = 450 + (22/3)·125/2 = 458.33… → 908.33…
    assert soap_flops(3, 5, 2, 10) == pytest.approx(150 + 369 + 450 + 22 * 125 / 6, rel=1e-12)


def test_soap_skips_a_side_above_max_precond_dim() -> None:
    # 4 × 20000, f = 10, k = 10000: only the 4-row side: 6·80000·4 = 1_920_000
    # + (22/3)·64/10 = 46.933…; elementwise 800_000. The 20000 side is skipped.
    expected = 1_920_000 + 22 * 64 / 30 + 800_000
    assert soap_flops(4, 20000, 10, 10000) == pytest.approx(expected, rel=1e-12)
    model = FlopsCost(OptimizerConfig("soap"))  # defaults f = 10, k = 10000
    assert model.matrix_cost(4, 20000) == pytest.approx(expected, rel=1e-12)
    assert model.matrix_cost(20000, 4) == pytest.approx(expected, rel=1e-12)


def test_soap_side_equal_to_max_precond_dim_is_kept() -> None:
    # k = 5: the 5 side is not above k, so it is preconditioned; the 6 side is skipped.
    # 5 × 6, f = 1: 6·30·5 = 900 + (22/3)·125 = 916.66…; + 300
    assert soap_flops(5, 6, 1, 5) == pytest.approx(900 + 22 * 125 / 3 + 300, rel=1e-12)


def test_soap_both_sides_above_max_precond_dim_is_elementwise_only() -> None:
    assert soap_flops(30, 40, 10, 20) == 12_000.0


# ---------------------------------------------------------------------------------------------
# AdamW and numel


def test_adamw_flops_are_ten_per_element() -> None:
    for name in ("muon", "shampoo", "soap"):
        assert FlopsCost(OptimizerConfig(name)).adamw_cost(7) == 70.0


def test_numel_cost_counts_elements() -> None:
    model = NumelCost()
    assert model.matrix_cost(3, 5) == 15.0
    assert model.matrix_cost(1024, 4096) == 4_194_304.0
    assert model.adamw_cost(7) == 7.0
    assert isinstance(model.matrix_cost(3, 5), float)


def test_make_cost_model_builds_both_models() -> None:
    opt = OptimizerConfig("soap")
    assert isinstance(make_cost_model("numel", opt), NumelCost)
    flops = make_cost_model("flops", opt)
    assert isinstance(flops, FlopsCost)
    assert flops.optimizer == opt


# ---------------------------------------------------------------------------------------------
# Per-parameter cost: split parameters cost the sum of their submatrices


def _qkv() -> ParamSpec:
    # Fused QKV of 12 rows: Q 8 rows, K 2, V 2, 4 columns.
    return ParamSpec("qkv", (12, 4), 0, MATRIX, submatrices=((8, 4), (2, 4), (2, 4)))


def test_split_param_costs_the_sum_of_submatrices_flops() -> None:
    model = FlopsCost(OptimizerConfig("muon", ns_steps=1))
    # (8,4): r=4,c=8: 4·16·8 + 2·64 = 640 + 320 = 960
    # (2,4): r=2,c=4: 4·4·4 + 2·8 = 80 + 80 = 160, twice
    assert param_cost(_qkv(), model) == 960.0 + 2 * 160.0
    # …which is not the cost of the fused 12×4 matrix.
    assert param_cost(_qkv(), model) != model.matrix_cost(12, 4)


def test_split_param_numel_cost_is_its_element_count() -> None:
    assert param_cost(_qkv(), NumelCost()) == 48.0


def test_unsplit_param_costs_its_own_shape() -> None:
    param = ParamSpec("w", (3, 5), None, MATRIX, submatrices=((3, 5),))
    assert param_cost(param, FlopsCost(OptimizerConfig("muon"))) == 1320.0


def test_adamw_param_cost_uses_full_numel() -> None:
    param = ParamSpec("norm", (6, 7), 0, ADAMW)
    assert param_cost(param, NumelCost()) == 42.0
    assert param_cost(param, FlopsCost(OptimizerConfig())) == 420.0


# ---------------------------------------------------------------------------------------------
# State bytes


def test_state_bytes_muon() -> None:
    assert matrix_state_bytes(3, 5, OptimizerConfig("muon")) == 60.0


def test_state_bytes_shampoo_by_hand() -> None:
    # 5 × 3, B = 2: per block 8·(bm² + bn²) + 4·bm·bn
    # (2,2) ×2: 64 + 16 = 80 → 160; (2,1) ×2: 40 + 8 = 48 → 96; (1,2): 48; (1,1): 16 + 4 = 20
    assert matrix_state_bytes(5, 3, OptimizerConfig("shampoo", block_size=2)) == 324.0
    # One block (B large): 8·(9 + 25) + 4·15 = 332
    assert matrix_state_bytes(3, 5, OptimizerConfig("shampoo")) == 332.0


def test_state_bytes_soap_by_hand() -> None:
    # 8mn + 8·(m² + n²) over sides ≤ k
    assert matrix_state_bytes(3, 5, OptimizerConfig("soap", max_precond_dim=10)) == 120.0 + 8 * 34
    assert matrix_state_bytes(3, 5, OptimizerConfig("soap", max_precond_dim=4)) == 120.0 + 8 * 9
    assert matrix_state_bytes(3, 5, OptimizerConfig("soap", max_precond_dim=2)) == 120.0


def test_param_state_bytes_adamw_and_split() -> None:
    assert param_state_bytes(ParamSpec("b", (10,), None, ADAMW, dtype="fp32"), OptimizerConfig()) == 80.0
    # a bf16 parameter adds its fp32 main copy (4 bytes per element)
    assert param_state_bytes(ParamSpec("b", (10,), None, ADAMW, dtype="bf16"), OptimizerConfig()) == 120.0
    fp32_qkv = dataclasses.replace(_qkv(), dtype="fp32")
    # muon: 4 bytes per element, summed over the pieces
    assert param_state_bytes(fp32_qkv, OptimizerConfig("muon")) == 4 * 48
    assert param_state_bytes(dataclasses.replace(_qkv(), dtype="bf16"), OptimizerConfig("muon")) == 8 * 48
    # soap: sum over submatrices, not the fused matrix
    soap = OptimizerConfig("soap")
    expected = sum(8 * m * n + 8 * (m * m + n * n) for m, n in ((8, 4), (2, 4), (2, 4)))
    assert param_state_bytes(fp32_qkv, soap) == expected
    assert expected != 8 * 48 + 8 * (144 + 16)


def test_adamw_slice_bytes_count_main_copies_of_low_precision_models() -> None:
    fp32 = [ParamSpec("b", (10,), None, ADAMW, dtype="fp32")]
    assert adamw_slice_bytes_per_element(fp32) == 8
    assert adamw_slice_bytes_per_element(fp32 + [ParamSpec("n", (4,), None, ADAMW, dtype="bf16")]) == 12


# ---------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("name", ["adam", "Muon", "", "lion"])
def test_unknown_optimizer_raises_plan_error(name: str) -> None:
    with pytest.raises(PlanError, match="unknown optimizer"):
        OptimizerConfig(name)


@pytest.mark.parametrize("field", ["ns_steps", "block_size", "precondition_frequency", "max_precond_dim"])
def test_nonpositive_optimizer_setting_raises_plan_error(field: str) -> None:
    with pytest.raises(PlanError, match=field):
        OptimizerConfig("muon", **{field: 0})


@pytest.mark.parametrize("name", ["time", "FLOPS", ""])
def test_unknown_cost_model_raises_plan_error(name: str) -> None:
    with pytest.raises(PlanError, match="unknown cost model"):
        make_cost_model(name, OptimizerConfig())


def test_plan_error_is_a_value_error() -> None:
    assert issubclass(PlanError, ValueError)
