"""Numerics of the DP reduction: how far the runtime's results move from an fp64 reference when
its gradients are summed in the backend's order (rooted reduces, gloo's reduce-scatter and
all-reduce) instead of rank order, for Muon, Shampoo and SOAP (AdamW on the rest).

Run:  python benchmarks/numerics.py            (a few minutes: 2 layouts x 3 optimizers x 3 reductions)
      python benchmarks/numerics.py --steps 6

The setting is the multi-process tests' (tests/runtime: the tiny MoE model, their optimizer
settings and hyperparameters, seeded parameters and per-rank gradients). For every parameter (rows: the matrix
optimizer's parameters; `adamw`: the AdamW ones, from the Muon runs)
it compares the total change after the run, Δ = x_end − x_start, of

- `runtime`: CanzonaOptimizer (or DP-SC) on 4 gloo ranks, in fp32;
- `ref32`: the single-process reference fed the fp32 DP mean summed in rank order (the tests'
  oracle);
- `ref64`: the same reference computing in fp64 from the fp64 DP mean (the yardstick);

as the worst parameter's normwise relative error ‖Δa − Δb‖ / ‖Δb‖, and as the rtol the tests'
elementwise check needs (`assert_close` with atol = rtol / 10). `grad err` is the first step's
DP-mean gradient of the runtime against ref32's (the summation-order difference itself);
`amplification` = the Δ error against ref32 / that gradient error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "runtime"))  # the tests' oracle: same model, gradients and settings

from canzona.runtime.tools.reference import ReferenceOptimizer  # noqa: E402
from canzona.schedules.format import Schedule  # noqa: E402

from rt_harness import DATA, make_groups, make_schedule, run_ranks  # noqa: E402
from rt_oracle import STRATEGIES, full_grad, full_params, ordered, reference_run, shard  # noqa: E402

MODEL = DATA / "tiny_moe.json"
# (label, optimizer, schedule settings, extra hyperparameters): the tests' settings, then the
# well-conditioned variants the rooted tests at DP 4 use (see docs/runtime.md, "Numerics").
CASES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    ("muon", "muon", {}, {}),
    ("shampoo", "shampoo", {"block_size": 16, "precondition_frequency": 2}, {}),
    ("soap", "soap", {"precondition_frequency": 2, "max_precond_dim": 40}, {}),
    ("shampoo, matrix_eps 1e-3", "shampoo", {"block_size": 16, "precondition_frequency": 2}, {"matrix_eps": 1e-3}),
    ("soap, max_precond_dim 16", "soap", {"precondition_frequency": 2, "max_precond_dim": 16}, {}),
    # Newton-Schulz products in bf16 (the CUDA default): ref32 is the reference at the same
    # precision, ref64 the exact fp64 one (the bf16 test's tolerance comes from this row).
    ("muon, ns_dtype bf16", "muon", {}, {"ns_dtype": "bf16"}),
]
HP = {"lr": 0.02, "weight_decay": 0.01, "adamw_lr": 0.01, "adamw_weight_decay": 0.01}
LAYOUTS = {"TP 2 x DP 2": (2, 2), "DP 4": (1, 4)}
RUNS = [("canzona", "rooted"), ("canzona", "all_to_all"), ("dp-sc", "all_reduce")]


def _worker(rank: int, world: int, schedule: Schedule, steps: int, strategy: str, hp: dict[str, Any]) -> dict[str, Any]:
    """Train this rank's shards; return them and the first step's DP-mean gradient pieces."""
    dp, tp = schedule.request.dp, schedule.request.tp
    dp_rank, tp_rank = divmod(rank, tp)
    dp_group, tp_group = make_groups(dp, tp)
    full = full_params(schedule)
    entries = ordered(schedule)
    params = [(e.name, torch.nn.Parameter(shard(full[e.name], e, tp_rank, tp))) for e in entries]
    optimizer = STRATEGIES[strategy](params, schedule, dp_group=dp_group, tp_group=tp_group, **hp)
    pieces: list[tuple[str, int, torch.Tensor]] = []
    for step in range(steps):
        for entry, (_, param) in zip(entries, params):
            param.grad = shard(full_grad(entry, step, dp_rank), entry, tp_rank, tp)
        if step == 0:
            optimizer.reduce_gradients()
            layout, send = optimizer.plan.layout, optimizer.engine.send  # reduced in place, at their positions
            for piece in layout.rank_pieces[dp_rank]:
                start = layout.flat[piece.param] + piece.src
                pieces.append((optimizer.names[piece.param], piece.src, send[start : start + piece.length].clone()))
        optimizer.step()
        optimizer.zero_grad()
    return {"params": {name: p.detach().clone() for name, p in params}, "grad_pieces": pieces}


def reference64(schedule: Schedule, steps: int, hp: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The reference in fp64 on the full tensors, fed the fp64 DP mean; its fp64 values."""
    dp = schedule.request.dp
    full = full_params(schedule)
    entries = ordered(schedule)
    params = [(e.name, torch.nn.Parameter(full[e.name].clone())) for e in entries]
    exact = {**hp, "ns_dtype": "fp32"}  # fp64 products: the yardstick for every precision
    optimizer = ReferenceOptimizer(params, schedule, dtype=torch.float64, **exact)
    for step in range(steps):
        grads = {e.name: torch.stack([full_grad(e, step, d).double() for d in range(dp)]).sum(0) / dp for e in entries}
        optimizer.step(grads)
    return {name: optimizer.state[p]["main"] for name, p in params}


def _mean32(schedule: Schedule, step: int) -> dict[str, torch.Tensor]:
    dp = schedule.request.dp
    return {
        e.name: torch.stack([full_grad(e, step, d).float() for d in range(dp)]).sum(0) / dp for e in ordered(schedule)
    }


def _normwise(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = float(want.double().norm())
    return float((got.double() - want.double()).norm()) / scale if scale else 0.0


def _needed_rtol(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.double() - want.double()).abs() / (0.1 + want.double().abs())).max())


def compare(
    schedule: Schedule, results: list[dict[str, Any]], ref32: dict[str, torch.Tensor], ref64: dict[str, torch.Tensor]
) -> dict[str, dict[str, float]]:
    """Per kind of parameter (matrix, adamw), the worst parameter's errors of every comparison
    (see the module docstring)."""
    tp = schedule.request.tp
    start = full_params(schedule)
    keys = ("grad", "rt64", "ref64", "rt32", "rtol_rt32", "rtol_rt64", "rtol_ref64")
    by_kind = {kind: {key: 0.0 for key in keys} for kind in ("matrix", "adamw")}
    entries = {e.name: e for e in schedule.params}
    mean = _mean32(schedule, 0)
    for rank, result in enumerate(results):
        for name, src, data in result["grad_pieces"]:
            entry = entries[name]
            local = shard(mean[name], entry, rank % tp, tp).reshape(-1)[src : src + data.numel()]
            worst = by_kind[entry.optimizer]
            worst["grad"] = max(worst["grad"], _normwise(data, local))
        for entry in ordered(schedule):
            worst = by_kind[entry.optimizer]
            begin = shard(start[entry.name], entry, rank % tp, tp).double()
            got = result["params"][entry.name]
            want32 = shard(ref32[entry.name], entry, rank % tp, tp)
            want64 = shard(ref64[entry.name], entry, rank % tp, tp)
            worst["rt64"] = max(worst["rt64"], _normwise(got.double() - begin, want64 - begin))
            worst["ref64"] = max(worst["ref64"], _normwise(want32.double() - begin, want64 - begin))
            worst["rt32"] = max(worst["rt32"], _normwise(got.double() - begin, want32.double() - begin))
            worst["rtol_rt32"] = max(worst["rtol_rt32"], _needed_rtol(got, want32))
            worst["rtol_rt64"] = max(worst["rtol_rt64"], _needed_rtol(got, want64))
            worst["rtol_ref64"] = max(worst["rtol_ref64"], _needed_rtol(want32, want64))
    return by_kind


def main() -> None:
    """Run every optimizer, layout and reduction; print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", help="run only the cases whose label contains this")
    args = parser.parse_args()
    print(
        "| optimizer | layout | reduction | grad err | Δ err runtime vs fp64 | Δ err ref32 vs fp64 "
        "| Δ err runtime vs ref32 | amplification | rtol runtime vs ref32 | rtol runtime vs fp64 | rtol ref32 vs fp64 |"
    )
    print("|" + "---|" * 11)
    for label, optimizer, settings, extra in CASES:
        if args.only and args.only not in label:
            continue
        for layout, (tp, dp) in LAYOUTS.items():
            schedule = make_schedule(MODEL, tp, dp, optimizer=optimizer, **settings)
            base = {**HP, **extra}
            ref32, ref64 = reference_run(schedule, args.steps, base), reference64(schedule, args.steps, base)
            for strategy, mode in RUNS:
                hp = base if strategy == "dp-sc" else {**base, "dp_collectives": mode}
                results = run_ranks(_worker, tp * dp, schedule, args.steps, strategy, hp, timeout=300)
                by_kind = compare(schedule, results, ref32, ref64)
                rows = [(label, by_kind["matrix"])] + ([("adamw", by_kind["adamw"])] if label == "muon" else [])
                for name, w in rows:
                    amplification = f"{w['rt32'] / w['grad']:.0f}x" if w["grad"] else "-"
                    print(
                        f"| {name} | {layout} | {strategy} {mode} | {w['grad']:.1e} | {w['rt64']:.1e} "
                        f"| {w['ref64']:.1e} | {w['rt32']:.1e} | {amplification} | {w['rtol_rt32']:.1e} "
                        f"| {w['rtol_rt64']:.1e} | {w['rtol_ref64']:.1e} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
