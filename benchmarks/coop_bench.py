"""Cooperative hosting (Muon): device balance and predicted optimizer stage, off vs auto.

Run:  python benchmarks/coop_bench.py            (the default 256-GPU layouts, a few minutes)
      python benchmarks/coop_bench.py --quick    (qwen3-32b tp8 dp32 and llama3.1-8b tp4 dp64)

Per layout, two plans built in this run (`--coop off` and the default `--coop auto`, Muon, flops
cost, α = 1): how many matrices auto hosts cooperatively, the device imbalance (busiest device /
mean device load), the busiest device's load against the device lower bound, the simulator's
optimizer stage (step minus DP collectives) and step on the H100 model, and planning time.

Device lower bound = max(total / (D · P), largest indivisible piece), total being the useful work
(matrices at their own cost, AdamW) over the D · P devices. Off, a matrix is indivisible; with
teams, a matrix whose long side splits P ways is a piece of 1/P of its cost (communication and the
replicated r x r products not counted: the bound stays a bound). `worst/bound` is the busiest
device's load (with the teams' overhead) over the bound of its own mode.
"""

from __future__ import annotations

import argparse
import time

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.cooperative import Shape
from canzona.planner.plan import PlanRequest, make_plan, team_shapes
from canzona.planner.predict.hardware import BUILTIN
from canzona.planner.predict.simulate import simulate
from canzona.planner.sources.load import load_model
from canzona.schedules.format import Schedule

LAYOUTS = [
    ("qwen3-1.7b", 8, 32, 1),
    ("qwen3-1.7b", 4, 64, 1),
    ("qwen3-4b", 8, 32, 1),
    ("qwen3-4b", 4, 64, 1),
    ("qwen3-8b", 8, 32, 1),
    ("qwen3-8b", 4, 64, 1),
    ("qwen3-14b", 8, 32, 1),
    ("qwen3-14b", 4, 64, 1),
    ("qwen3-32b", 8, 32, 1),
    ("qwen3-32b", 4, 64, 1),
    ("qwen3-1.7b", 2, 128, 1),
    ("qwen3-4b", 2, 128, 1),
    ("llama3.1-8b", 8, 32, 1),
    ("llama3.1-8b", 4, 64, 1),
    ("llama3.1-70b", 8, 32, 1),
    ("qwen3-30b-a3b", 4, 64, 8),
    ("qwen3-235b-a22b", 4, 64, 8),
]
QUICK = [("qwen3-32b", 8, 32, 1), ("llama3.1-8b", 4, 64, 1)]


def device_bound(schedule: Schedule, shapes: dict[str, Shape], teams: bool) -> float:
    """max(total / (D · P), largest indivisible piece) (see the module docstring)."""
    tp = schedule.request.tp
    matrices = [e for e in schedule.params if e.owner is not None]
    total = sum(e.cost for e in matrices) + sum(schedule.metrics.dp.adamw_load)
    pieces = [e.cost / tp if teams and e.name in shapes and shapes[e.name].splits(tp, tp) else e.cost for e in matrices]
    return max(total / len(schedule.metrics.device), max(pieces))


def row(name: str, tp: int, dp: int, ep: int) -> list[str]:
    """One table row: off vs auto."""
    model = load_model(name, tp)
    cells: dict[str, tuple[Schedule, float]] = {}
    for coop in ("off", "auto"):
        started = time.perf_counter()
        request = PlanRequest(name, tp, dp, ep=ep, coop=coop)
        cells[coop] = (compile_schedule(make_plan(model, request)), time.perf_counter() - started)
    shapes = team_shapes(model, PlanRequest(name, tp, dp, ep=ep))
    off, auto = cells["off"][0], cells["auto"][0]
    sims = {coop: simulate(cells[coop][0], BUILTIN["h100"]).get("canzona") for coop in cells}
    out = [name, f"tp{tp} dp{dp}" + (f" ep{ep}" if ep > 1 else ""), str(auto.metrics.tp.cooperative)]
    for schedule in (off, auto):
        out.append(f"{schedule.metrics.tp.device_imbalance:.3f}")
    for schedule, teams in ((off, False), (auto, True)):
        out.append(f"{schedule.metrics.tp.worst_device_load / device_bound(schedule, shapes, teams):.3f}")
    stage_off, stage_auto = sims["off"].optimizer_stage * 1e3, sims["auto"].optimizer_stage * 1e3
    out += [
        f"{stage_off:.1f}",
        f"{stage_auto:.1f}",
        f"{stage_off / stage_auto:.2f}x",
        f"{sims['off'].step * 1e3:.1f}",
        f"{sims['auto'].step * 1e3:.1f}",
        f"{cells['off'][1]:.2f}",
        f"{cells['auto'][1]:.2f}",
    ]
    return out


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two layouts only")
    args = parser.parse_args()
    header = [
        "model",
        "layout",
        "teams",
        "imbalance off",
        "imbalance auto",
        "worst/bound off",
        "worst/bound auto",
        "opt stage off ms",
        "opt stage auto ms",
        "speedup",
        "step off ms",
        "step auto ms",
        "plan off s",
        "plan auto s",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for layout in QUICK if args.quick else LAYOUTS:
        print("| " + " | ".join(row(*layout)) + " |", flush=True)


if __name__ == "__main__":
    main()
