"""Moving optimizer state between schedules: compatibility verdicts with reasons, the state
byte formulas, and the per-rank byte accounting of `reshard_report`."""

from __future__ import annotations

import math
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.load import load_model
from canzona.planner.spec import ModelOptions
from canzona.schedules.format import Schedule, ScheduleError, read_schedule
from canzona.schedules.library import resolve_schedule
from canzona.schedules.reshard import (
    ParamState,
    StateLayout,
    incompatibilities,
    padding_notes,
    reshard_report,
    state_fields,
    state_layout,
)

DATA = Path(__file__).resolve().parents[1] / "runtime" / "data"
TINY, TINY_V300 = DATA / "tiny_moe.json", DATA / "tiny_moe_v300.json"


@cache
def plan(
    model: Path,
    tp: int,
    dp: int,
    optimizer: str = "muon",
    alpha: float = 1.0,
    split_fc1: bool = False,
    bucket_size: int = 4000,
    **settings: Any,
) -> Schedule:
    options = ModelOptions(split_fc1=split_fc1)
    request = PlanRequest(
        str(model),
        tp,
        dp,
        optimizer=OptimizerConfig(optimizer, **settings),
        alpha=alpha,
        bucket_size=bucket_size,
        options=options,
        group_bytes=4096,
    )
    return compile_schedule(make_plan(load_model(str(model), tp, options), request))


def test_state_byte_formulas() -> None:
    assert state_fields("muon", 40, 24, 16, 10) == [("momentum", (40, 24))]
    shampoo = dict(state_fields("shampoo", 40, 24, 16, 10))
    blocks = [(m, n) for m in (16, 16, 8) for n in (16, 8)]
    assert len(shampoo) == 1 + 4 * len(blocks) and shampoo["blocks/5/R_root"] == (8, 8)
    assert sum(r * c for r, c in shampoo.values()) == 40 * 24 + 2 * sum(m * m + n * n for m, n in blocks)
    soap = dict(state_fields("soap", 40, 24, 16, 30))  # 40 rows are above the limit: no L/QL
    assert soap == {"exp_avg": (40, 24), "exp_avg_sq": (40, 24), "R": (24, 24), "QR": (24, 24)}
    layout = state_layout(plan(TINY, 2, 2))  # bf16 parameters: each has an fp32 main copy
    matrices = [p for p in layout.params if p.kind == "matrix"]
    assert {p.dtype for p in layout.params} == {"bf16"}
    assert sum(layout.state_nbytes(p) for p in matrices) == 4 * sum(p.shape[0] * p.shape[1] for p in matrices)
    assert sum(layout.nbytes(p) for p in matrices) == 8 * sum(p.shape[0] * p.shape[1] for p in matrices)
    adamw = next(p for p in layout.params if p.name == "embedding.word_embeddings.weight")
    assert layout.state_nbytes(adamw) == 8 * 256 * 32 and layout.nbytes(adamw) == 12 * 256 * 32
    assert StateLayout.from_json(layout.to_json()) == layout


def test_main_copies_move_only_between_low_precision_layouts() -> None:
    import dataclasses

    bf16 = plan(TINY, 2, 2)
    spec = load_model(str(TINY), 2, ModelOptions())
    spec = dataclasses.replace(spec, params=tuple(dataclasses.replace(p, dtype="fp32") for p in spec.params))
    request = PlanRequest(str(TINY), 2, 2, optimizer=OptimizerConfig("muon"), bucket_size=4000, group_bytes=4096)
    fp32 = compile_schedule(make_plan(spec, request))
    mains = sum(p.main_bytes for p in state_layout(bf16).params)
    assert mains == 4 * sum(math.prod(e.shape) for e in bf16.params) and not any(
        p.main_bytes for p in state_layout(fp32).params
    )
    down, up, same = reshard_report(bf16, fp32), reshard_report(fp32, bf16), reshard_report(bf16, bf16)
    assert down.compatible and up.compatible, "main copies do not decide compatibility"
    assert down.state_bytes == same.state_bytes == up.state_bytes + mains, "what is written: main copies only from bf16"
    assert sum(down.loads) == sum(up.loads), "what is read: main copies only when both sides have them"
    assert sum(same.loads) - sum(up.loads) >= mains  # replicated norms' copies are read by every TP rank


def _per_element(param: ParamState) -> int:
    """AdamW state bytes per element: two fp32 moments and, for bf16, the fp32 main copy."""
    return 8 + (4 if param.dtype != "fp32" else 0)


def test_the_same_schedule_moves_nothing() -> None:
    schedule = plan(TINY, 2, 2)
    report = reshard_report(schedule, schedule)
    assert report.compatible and not report.problems and not report.notes
    assert report.flows == [] and not any(report.moved_in) and not any(report.moved_out)
    assert sum(report.writes) == report.state_bytes
    replicated = sum(
        _per_element(p) * p.shape[0] for p in state_layout(schedule).params if p.kind == "adamw" and len(p.shape) == 1
    )
    assert sum(report.loads) == report.state_bytes + replicated  # both TP ranks read the norms


@pytest.mark.parametrize("move", ["up", "down"])
def test_another_layout_accounts_for_every_byte(move: str) -> None:
    old, new = plan(TINY_V300, 1, 4, alpha=0.0), plan(TINY_V300, 2, 2, bucket_size=3000)
    if move == "down":
        old, new = new, old
    report = reshard_report(old, new)
    assert report.compatible, report.problems
    assert [note.split(":")[0] for note in report.notes] == ["embedding.word_embeddings.weight", "output_layer.weight"]
    assert (
        "384 rows before, 512 now" in report.notes[0] if move == "up" else "512 rows before, 384 now" in report.notes[0]
    )
    assert sum(report.writes) == report.state_bytes
    assert sum(report.moved_in) == sum(report.moved_out) == sum(n for _, _, n in report.flows) > 0
    assert all(s != t for s, t, _ in report.flows)
    layout = state_layout(new)
    tp = new.request.tp
    common_rows = 384  # the vocab rows both layouts have
    expected = 0
    for p in layout.params:
        if p.kind == "matrix":
            expected += layout.nbytes(p)
        elif len(p.shape) == 1:
            expected += _per_element(p) * p.shape[0] * tp
        else:
            expected += _per_element(p) * common_rows * p.shape[1]
    assert sum(report.loads) == expected


def test_incompatible_schedules_say_why() -> None:
    base = plan(TINY, 2, 2)
    cases = {
        "different models: tiny_moe": plan(TINY_V300, 2, 2),
        "different matrix optimizers: muon before, soap now": plan(TINY, 2, 2, optimizer="soap"),
        "linear_fc1.weight: updated as submatrices [[64, 32]] before, [[32, 32], [32, 32]] now": plan(
            TINY, 2, 2, split_fc1=True
        ),
    }
    for fragment, other in cases.items():
        report = reshard_report(base, other)
        assert not report.compatible and fragment in report.problems[0], report.problems
        assert report.loads == [] and report.flows == []
    blocks = reshard_report(
        plan(TINY, 2, 2, optimizer="shampoo", block_size=16), plan(TINY, 1, 4, optimizer="shampoo", block_size=32)
    )
    assert not blocks.compatible and "block_size 16 vs 32" in blocks.problems[0]
    soap = plan(TINY, 2, 2, optimizer="soap", max_precond_dim=40)
    assert not reshard_report(soap, plan(TINY, 2, 2, optimizer="soap", max_precond_dim=100)).compatible  # fc1's 64 rows
    assert reshard_report(
        soap, plan(TINY, 2, 2, optimizer="soap", max_precond_dim=50)
    ).compatible  # no side in (40, 50]


def test_layout_rules_by_hand() -> None:
    def layout(*params: ParamState, sha: str | None = "abc") -> StateLayout:
        return StateLayout(("m", "/a/m.json", sha), "muon", 1024, 10000, params)

    w = ParamState("w", "matrix", (8, 4), ((8, 4),))
    emb = ParamState("emb", "adamw", (256, 4))
    old = layout(w, emb, ParamState("gone", "adamw", (4,)))
    new = layout(
        ParamState("w", "adamw", (8, 4)), ParamState("emb", "adamw", (256, 8)), ParamState("fresh", "adamw", (4,))
    )
    problems = incompatibilities(old, new)
    assert (
        problems[0] == "parameters no longer present: gone" and problems[1] == "parameters without saved state: fresh"
    )
    assert (
        "w: updated by matrix before, by adamw now" in problems[2]
        and "emb: full shape [256, 4] before, [256, 8] now" in problems[2]
    )
    moved = StateLayout(("m", "/b/m.json", "abc"), "muon", 1024, 10000, (w, emb))  # the same file, read elsewhere
    assert incompatibilities(layout(w, emb), moved) == []
    assert incompatibilities(layout(w, emb), layout(w, emb, sha="abd"))[0].startswith("different models")
    padded = layout(w, ParamState("emb", "adamw", (384, 4)))
    assert incompatibilities(layout(w, emb), padded) == [] and padding_notes(layout(w, emb), padded)[0].startswith(
        "emb: 256 rows"
    )
    assert StateLayout.from_json(padded.to_json()) == padded
    with pytest.raises(ValueError, match="not a state layout"):
        StateLayout.from_json({"model": {}})


def test_expert_parallel_layouts_move_their_experts_and_inconsistent_schedules_fail() -> None:
    base = plan(TINY, 2, 2)
    moe4 = DATA / "tiny_moe4.json"
    ep2, ep4 = (
        compile_schedule(
            make_plan(
                load_model(str(moe4), 1, ModelOptions()),
                PlanRequest(str(moe4), 1, 4, ep=ep, bucket_size=2000, group_bytes=4096),
            )
        )
        for ep in (2, 4)
    )
    report = reshard_report(ep2, ep4)
    assert report.compatible and report.notes == ["experts: EP 2 -> EP 4, 6 of 8 expert matrices change EP rank"]
    assert 0 < sum(report.moved_in) <= report.state_bytes and report.flows  # experts whose DP rank changes
    assert reshard_report(ep4, ep4).notes == ["experts: EP 4 -> EP 4, 0 of 8 expert matrices change EP rank"]
    assert reshard_report(ep4, ep4).flows == []
    hollow = base.model_copy(update={"tp": base.tp.model_copy(update={"ranks": []})})
    with pytest.raises(ScheduleError, match="no micro-group hosts"):
        reshard_report(hollow, base)


def test_fused_rows_without_row_blocks_are_noted_when_tp_changes(tmp_path: Path) -> None:
    model = tmp_path / "plist.yaml"
    model.write_text(
        "name: plist\nparams:\n"
        "  - {name: layers.0.mlp.linear_fc1.weight, shape: [64, 32], tp_dim: 0}\n"
        "  - {name: layers.0.mlp.linear_fc2.weight, shape: [32, 32], tp_dim: 1}\n"
        "  - {name: norm.weight, shape: [32], tp_dim: null}\n"
    )
    one, two = plan(model, 1, 2), plan(model, 2, 1)
    notes = reshard_report(one, two).notes
    assert len(notes) == 1 and notes[0].startswith("layers.0.mlp.linear_fc1.weight: no row blocks at TP > 1")
    assert reshard_report(two, two).notes == []
    assert reshard_report(plan(TINY, 1, 4), plan(TINY, 2, 2)).notes == []  # the catalog records fc1's row blocks


def test_library_schedules_across_a_vocab_padding_change() -> None:
    old = read_schedule(resolve_schedule("qwen3-8b/muon-tp2-dp4"))
    new = read_schedule(resolve_schedule("qwen3-8b/muon-tp8-dp32"))
    report = reshard_report(old, new)
    assert report.compatible and len(report.loads) == 256 and len(report.writes) == 8
    assert "152064 rows before, 152576 now" in report.notes[0]
    assert sum(report.writes) == report.state_bytes
