"""Megatron ZeRO-1 buffer geometry."""

from __future__ import annotations

from math import lcm

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from canzona.planner.partition.layout import (
    BUCKET_END_ALIGNMENT,
    PARAM_ALIGNMENT,
    BufferLayout,
    build_buffer,
    build_layouts,
    equal_cuts,
)
from canzona.planner.sources.load import load_model
from canzona.planner.spec import ADAMW, MATRIX, ModelSpec, ParamSpec, PlanError


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _matrix(name: str, rows: int, cols: int, tp_dim: int | None = None) -> ParamSpec:
    return ParamSpec(name, (rows, cols), tp_dim, MATRIX, submatrices=((rows, cols),))


def _adamw(name: str, size: int, tp_dim: int | None = None) -> ParamSpec:
    return ParamSpec(name, (size,), tp_dim, ADAMW)


def _model(*params: ParamSpec) -> ModelSpec:
    return ModelSpec("toy", tuple(params), "test")


# ---------------------------------------------------------------------------------------------
# A hand-laid-out example


def _toy() -> ModelSpec:
    return _model(
        _matrix("a", 10, 10),  # 100
        _adamw("b", 7),
        _matrix("c", 3, 50, tp_dim=1),  # 150 (75 at tp 2)
        _matrix("d", 2, 2),  # 4
    )


def test_hand_computed_layout_tp1() -> None:
    layout = build_buffer(_toy(), MATRIX, tp=1, dp=3, bucket_size=200)
    # Reverse order: d (index 3) at 0, fill 4; c (index 2) at 64, fill 214 ≥ 200 → bucket closes,
    # padded to a multiple of lcm(3, 128) = 384. Then a (index 0) alone in bucket 1.
    assert [(e.param, e.bucket, e.offset, e.numel) for e in layout.buckets[0].entries] == [
        (3, 0, 0, 4),
        (2, 0, 64, 150),
    ]
    assert layout.buckets[0].numel == 384
    assert [(e.param, e.bucket, e.offset, e.numel) for e in layout.buckets[1].entries] == [(0, 1, 0, 100)]
    assert layout.buckets[1].numel == 384
    assert layout.numel == 768
    assert layout.kind == MATRIX
    assert layout.buckets[0].boundaries() == (0, 64, 384)
    assert layout.buckets[0].spans() == (64, 320)
    assert layout.buckets[1].spans() == (384,)


def test_hand_computed_layout_tp2_uses_local_sizes() -> None:
    layout = build_buffer(_toy(), MATRIX, tp=2, dp=3, bucket_size=200)
    # c is split on dim 1 → 75 local elements; d (4) at 0, c at 64 → fill 139 < 200;
    # a (not split, 100) at 192 → fill 292 ≥ 200 → one bucket, padded to 384.
    assert len(layout.buckets) == 1
    bucket = layout.buckets[0]
    assert [(e.param, e.offset, e.numel) for e in bucket.entries] == [(3, 0, 4), (2, 64, 75), (0, 192, 100)]
    assert bucket.numel == 384


def test_adamw_buffer_is_separate() -> None:
    layouts = build_layouts(_toy(), tp=1, dp=3, bucket_size=200)
    assert set(layouts) == {MATRIX, ADAMW}
    adamw = layouts[ADAMW]
    assert adamw.kind == ADAMW
    assert [(e.param, e.offset, e.numel) for b in adamw.buckets for e in b.entries] == [(1, 0, 7)]
    assert adamw.buckets[0].numel == 384
    matrix_params = {e.param for b in layouts[MATRIX].buckets for e in b.entries}
    assert matrix_params == {0, 2, 3}


def test_bucket_closes_exactly_at_bucket_size() -> None:
    # Two 64-element params with bucket size 64: each closes its own bucket.
    model = _model(_matrix("x", 8, 8), _matrix("y", 8, 8))
    layout = build_buffer(model, MATRIX, tp=1, dp=1, bucket_size=64)
    assert [[e.param for e in b.entries] for b in layout.buckets] == [[1], [0]]
    # With 65 the first bucket holds both (64 < 65, then 128 ≥ 65).
    layout = build_buffer(model, MATRIX, tp=1, dp=1, bucket_size=65)
    assert [[e.param for e in b.entries] for b in layout.buckets] == [[1, 0]]


def test_bucket_end_alignment_is_lcm_of_dp_and_128() -> None:
    model = _model(_matrix("x", 1, 1))
    for dp, expected in [(1, 128), (2, 128), (3, 384), (5, 640), (64, 128), (96, 384), (256, 256)]:
        assert build_buffer(model, MATRIX, tp=1, dp=dp, bucket_size=10).buckets[0].numel == expected


def test_empty_buffer_has_no_buckets() -> None:
    layout = build_buffer(_model(_matrix("x", 4, 4)), ADAMW, tp=1, dp=2, bucket_size=10)
    assert layout.buckets == ()
    assert layout.numel == 0


@pytest.mark.parametrize("bucket_size", [0, -1])
def test_bad_bucket_size_raises(bucket_size: int) -> None:
    with pytest.raises(PlanError, match="bucket size"):
        build_buffer(_toy(), MATRIX, tp=1, dp=2, bucket_size=bucket_size)


def test_equal_cuts() -> None:
    assert equal_cuts(384, 3) == (0, 128, 256, 384)
    assert equal_cuts(128, 1) == (0, 128)
    assert equal_cuts(0, 4) == (0, 0, 0, 0, 0)


# ---------------------------------------------------------------------------------------------
# Invariants, checked on presets and on random parameter lists


def check_layout(model: ModelSpec, layout: BufferLayout, kind: str, tp: int, dp: int, bucket_size: int) -> None:
    expected_params = [i for i in reversed(range(len(model.params))) if model.params[i].optimizer == kind]
    entries = [e for b in layout.buckets for e in b.entries]
    # Reverse registration order, each parameter of this class exactly once.
    assert [e.param for e in entries] == expected_params
    end_alignment = lcm(dp, BUCKET_END_ALIGNMENT)
    assert layout.kind == kind
    for position, bucket in enumerate(layout.buckets):
        assert bucket.index == position
        assert bucket.entries, "no empty buckets"
        fill = 0
        for i, entry in enumerate(bucket.entries):
            param = model.params[entry.param]
            assert entry.bucket == bucket.index
            assert entry.offset % PARAM_ALIGNMENT == 0
            assert entry.offset == _round_up(fill, PARAM_ALIGNMENT)
            local = param.numel if param.tp_dim is None else param.numel // tp
            assert entry.numel == local
            # The bucket had not reached its size before its last entry.
            if i < len(bucket.entries) - 1:
                assert entry.offset + entry.numel < bucket_size
            fill = entry.offset + entry.numel
        if position < len(layout.buckets) - 1:
            assert fill >= bucket_size  # closed because it reached the bucket size
        assert bucket.numel % end_alignment == 0
        assert fill <= bucket.numel < fill + end_alignment
        # boundaries / spans
        bounds = bucket.boundaries()
        assert bounds == tuple(e.offset for e in bucket.entries) + (bucket.numel,)
        assert bounds[0] == 0
        assert all(a < b for a, b in zip(bounds, bounds[1:]))
        spans = bucket.spans()
        assert len(spans) == len(bucket.entries)
        assert sum(spans) == bucket.numel
        assert all(span >= e.numel for span, e in zip(spans, bucket.entries))
        assert all(bounds[i] + spans[i] == bounds[i + 1] for i in range(len(spans)))
    assert layout.numel == sum(b.numel for b in layout.buckets)


@pytest.mark.parametrize(
    ("name", "tp", "dp", "bucket_size"),
    [("qwen3-0.6b", 1, 4, 40_000_000), ("qwen3-8b", 2, 4, 10_000_000), ("mixtral-8x7b", 2, 3, 40_000_000)],
)
def test_preset_layouts(name: str, tp: int, dp: int, bucket_size: int) -> None:
    model = load_model(name, tp)
    layouts = build_layouts(model, tp, dp, bucket_size)
    for kind, layout in layouts.items():
        check_layout(model, layout, kind, tp, dp, bucket_size)
    covered = {e.param for layout in layouts.values() for b in layout.buckets for e in b.entries}
    assert covered == set(range(len(model.params)))


@st.composite
def random_models(draw: st.DrawFn) -> tuple[ModelSpec, int]:
    tp = draw(st.sampled_from([1, 2, 4]))
    count = draw(st.integers(1, 14))
    params = []
    for i in range(count):
        if draw(st.booleans()):
            rows = tp * draw(st.integers(1, 40))
            cols = tp * draw(st.integers(1, 40))
            params.append(_matrix(f"m{i}", rows, cols, draw(st.sampled_from([None, 0, 1]))))
        else:
            size = tp * draw(st.integers(1, 300))
            params.append(_adamw(f"a{i}", size, draw(st.sampled_from([None, 0]))))
    return _model(*params), tp


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    random_models(),
    st.integers(1, 20),
    st.one_of(st.integers(1, 3000), st.just(40_000_000)),
)
def test_random_layouts(model_and_tp: tuple[ModelSpec, int], dp: int, bucket_size: int) -> None:
    model, tp = model_and_tp
    layouts = build_layouts(model, tp, dp, bucket_size)
    for kind, layout in layouts.items():
        check_layout(model, layout, kind, tp, dp, bucket_size)
    covered = sorted(e.param for layout in layouts.values() for b in layout.buckets for e in b.entries)
    assert covered == list(range(len(model.params)))
    # Deterministic and independent of the other buffer.
    assert build_buffer(model, MATRIX, tp, dp, bucket_size) == layouts[MATRIX]
