"""Planner benchmark: balance of canzona vs the baselines, TP modes, α trade-off, planning time,
planning at 1024 devices, device-aware ownership, and the CLI's start-up.

Run:  python benchmarks/plan_bench.py            (the balance, TP and α tables, a few minutes)
      python benchmarks/plan_bench.py --quick    (one repeat, smaller α sweep)
      python benchmarks/plan_bench.py --scale    (every preset at 1024 devices, with and without EP,
                                                  each in a fresh process: target under 30 s)
      python benchmarks/plan_bench.py --startup  (`canzona --version` and `-h`: target under 0.3 s)
      python benchmarks/plan_bench.py --device   (the busiest device with and without device-aware
                                                  DP ownership, and the predicted step)

Every figure comes from plans built in this run; times are medians of repeated runs. Ratios are
against what the same run measured: a bare interpreter (start-up), the 30 s budget (scale), the
plan without the device stage (device).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time

from library_bench import median_seconds

from canzona.planner.compile import compile_schedule
from canzona.planner.devices import tp_score
from canzona.planner.plan import PlanRequest, make_plan, mode_groups
from canzona.planner.sources.load import load_model
from canzona.schedules.format import Schedule, dump_schedule, parse_schedule

LAYOUTS = [("qwen3-8b", 2, 4), ("qwen3-32b", 8, 32), ("qwen3-235b-a22b", 4, 64)]
ALPHAS = [0.0, 0.25, 0.5, 0.75, 0.9, 1.0]
BASELINES = ["dp-sc", "zero1-gather", "start-owner", "layer-wise"]


def timed_plan(name: str, tp: int, dp: int, alpha: float, repeats: int, ep: int = 1) -> tuple[Schedule, float]:
    """The schedule and the median wall time of load + plan + compile."""
    times, schedule = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        request = PlanRequest(name, tp, dp, alpha=alpha, ep=ep)
        schedule = compile_schedule(make_plan(load_model(name, tp), request))
        times.append(time.perf_counter() - started)
    assert schedule is not None
    return schedule, statistics.median(times)


def balance_table(repeats: int) -> None:
    """DP balance of canzona and every baseline (flops, α = 1), and planning time."""
    print("## DP balance, Muon flops, alpha = 1 (max load / lower bound; imbalance = max / mean)\n")
    header = ["model", "layout", "canzona"] + BASELINES + ["plan s", "write s", "load s", "file MB"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, tp, dp in LAYOUTS:
        schedule, seconds = timed_plan(name, tp, dp, 1.0, repeats)
        started = time.perf_counter()
        text = dump_schedule(schedule)
        written = time.perf_counter() - started
        started = time.perf_counter()
        parse_schedule(text)
        loaded = time.perf_counter() - started
        metrics = schedule.metrics.dp
        cells = [f"{1 + metrics.gap:.4f} / {metrics.imbalance:.4f}"]
        cells += [f"{1 + metrics.baselines[b].gap:.3f} / {metrics.baselines[b].imbalance:.3f}" for b in BASELINES]
        row = [
            name,
            f"tp{tp} dp{dp}",
            *cells,
            f"{seconds:.2f}",
            f"{written:.2f}",
            f"{loaded:.2f}",
            f"{len(text) / 1e6:.1f}",
        ]
        print("| " + " | ".join(row) + " |")
    print()


def tp_table(repeats: int) -> None:
    """TP micro-group modes on the same DP partition."""
    print("## TP micro-group modes (efficiency; critical path / lower bound; device imbalance; groups)\n")
    print("| model | layout | rollback | fixed | sorted | heap |")
    print("|---|---|---|---|---|---|")
    layouts = [
        ("qwen3-8b", 2, 4, 1),
        ("qwen3-32b", 8, 32, 1),
        ("qwen3-235b-a22b", 4, 16, 8),
        ("qwen3-30b-a3b", 4, 8, 4),
    ]
    for name, tp, dp, ep in layouts:
        plan = make_plan(load_model(name, tp), PlanRequest(name, tp, dp, ep=ep))
        bound = compile_schedule(plan).metrics.tp.critical_lower_bound
        # A schedule records the chosen mode only: the others are scored on the plan itself.
        cells = [
            f"{s.efficiency:.4f}; {s.critical_time / bound:.4f}; {s.device_imbalance:.4f}; {s.num_groups} groups"
            for s in (tp_score(plan, mode_groups(plan, m)) for m in ("rollback", "fixed", "sorted", "heap"))
        ]
        print(f"| {name} | tp{tp} dp{dp} ep{ep} | " + " | ".join(cells) + " |")
    print()


def alpha_table(alphas: list[float]) -> None:
    """What α trades: compute balance against slice equality (padding overhead)."""
    print("## alpha trade-off, qwen3-32b tp8 dp32 and qwen3-8b tp2 dp4 (Muon flops)\n")
    print("| model | alpha | max load / lower bound | padding overhead (mean) | worst bucket |")
    print("|---|---|---|---|---|")
    for name, tp, dp in [("qwen3-32b", 8, 32), ("qwen3-8b", 2, 4)]:
        for alpha in alphas:
            schedule, _ = timed_plan(name, tp, dp, alpha, 1)
            metrics = schedule.metrics.dp
            print(
                f"| {name} | {alpha:g} | {1 + metrics.gap:.4f} | {metrics.padding_overhead:.2f}x "
                f"| {metrics.max_padding_overhead:.2f}x |"
            )
    print()


# Every preset at 1024 devices (dense: tp 8 x dp 128; MoE: tp 4 x dp 256, tp <= 4 for Qwen3 MoE,
# with ep 8 and without EP; mixtral tp 8 x dp 128), and the two slow examples.
DENSE = [
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-4b",
    "qwen3-8b",
    "qwen3-14b",
    "qwen3-32b",
    "llama3.1-8b",
    "llama3.1-70b",
    "llama3.1-405b",
]
SCALE = [(name, 8, 128, 1, 1.0) for name in DENSE] + [
    ("mixtral-8x7b", 8, 128, 8, 1.0),
    ("mixtral-8x7b", 8, 128, 1, 1.0),
    ("qwen3-30b-a3b", 4, 256, 8, 1.0),
    ("qwen3-30b-a3b", 4, 256, 1, 1.0),
    ("qwen3-235b-a22b", 4, 256, 8, 1.0),
    ("qwen3-235b-a22b", 4, 256, 1, 1.0),
    ("deepseek-v3", 4, 256, 8, 1.0),
    ("deepseek-v3", 4, 256, 1, 1.0),
    ("deepseek-v3", 8, 1024, 1, 1.0),
    ("qwen3-235b-a22b", 2, 16, 4, 0.75),
]
BUDGET_S = 30.0
STARTUP_TARGET_S = 0.3
PROBE = """
import json, resource, sys, time
started, cpu = time.perf_counter(), time.process_time()
from canzona.planner.compile import compile_schedule
from canzona.planner.plan import PlanRequest
from canzona.planner.predict.auto_alpha import plan_for_request
from canzona.planner.predict.headline import step_headline
from canzona.planner.sources.load import load_model
from canzona.schedules.writing import dump_schedule
name, tp, dp, ep, alpha = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
plan, _ = plan_for_request(load_model(name, tp), PlanRequest(name, tp, dp, ep=ep, alpha=alpha))
schedule = compile_schedule(plan)
step_headline(schedule)
dump_schedule(schedule)
print(json.dumps({"wall": time.perf_counter() - started, "cpu": time.process_time() - cpu,
                  "mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "gap": schedule.metrics.dp.gap,
                  "device_gap": schedule.metrics.tp.device_gap}))
"""


def scale_table() -> None:
    """What `canzona plan` does (load, plan with every candidate of the objective, compile, the
    headline, the file's text) for every 1024-device preset, each in a fresh process."""
    print(
        "## Planning at 1024 devices (load, plan, compile, headline, YAML text; a fresh process each; "
        f"budget {BUDGET_S:.0f} s)\n"
    )
    header = ["preset", "layout", "alpha", "wall s", "CPU s", "wall / budget", "peak MiB", "DP gap", "device gap"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, tp, dp, ep, alpha in SCALE:
        out = subprocess.run(
            [sys.executable, "-c", PROBE, name, str(tp), str(dp), str(ep), str(alpha)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        r = json.loads(out)
        layout = f"tp{tp} dp{dp}" + (f" ep{ep}" if ep > 1 else "")
        print(
            f"| {name} | {layout} | {alpha:g} | {r['wall']:.1f} | {r['cpu']:.1f} | {r['wall'] / BUDGET_S:.2f} | "
            f"{r['mib']:.0f} | {r['gap']:.2%} | {r['device_gap']:.2%} |"
        )
    print()


def _median_run(command: list[str], repeats: int) -> float:
    return median_seconds(
        lambda: subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True), repeats
    )


def startup_table(repeats: int) -> None:
    """Wall time of `canzona --version` and `canzona -h` against a bare interpreter."""
    exe = shutil.which("canzona") or "canzona"
    bare = _median_run([sys.executable, "-c", "pass"], repeats)
    print(f"## CLI start-up (median of {repeats}; target {STARTUP_TARGET_S} s)\n")
    print("| command | wall s | over a bare python | wall / target |")
    print("|---|---|---|---|")
    print(f"| python -c pass | {bare:.3f} | 1.00x | {bare / STARTUP_TARGET_S:.2f} |")
    for args in (["--version"], ["-h"], ["show", "qwen3-8b/muon-tp2-dp4"]):
        seconds = _median_run([exe, *args], repeats)
        print(
            f"| canzona {' '.join(args)} | {seconds:.3f} | {seconds / bare:.2f}x | {seconds / STARTUP_TARGET_S:.2f} |"
        )
    print()


DEVICE_LAYOUTS = [
    ("qwen3-8b", 4, 64),
    ("qwen3-8b", 8, 32),
    ("qwen3-4b", 4, 64),
    ("qwen3-32b", 8, 32),
    ("llama3.1-8b", 4, 64),
    ("llama3.1-70b", 8, 128),
]


def device_table() -> None:
    """Busiest device and predicted step with and without device-aware DP ownership."""
    from canzona.planner.partition import device_aware
    from canzona.planner.plan import TrainingSetup
    from canzona.planner.predict.hardware import BUILTIN
    from canzona.planner.predict.simulate import simulate

    print("## Device-aware DP ownership (Muon, flops, alpha 1; H100 model for the step)\n")
    header = [
        "model",
        "layout",
        "worst device off",
        "worst device on",
        "on / off",
        "DP gap off",
        "DP gap on",
        "device gap on",
        "step ms off",
        "step ms on",
        "iteration ms off",
        "iteration ms on",
    ]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    limit = device_aware.MAX_RANK_TASKS
    for name, tp, dp in DEVICE_LAYOUTS:
        rows = []
        for cap in (-1, limit):
            device_aware.MAX_RANK_TASKS = cap
            schedule = compile_schedule(make_plan(load_model(name, tp), PlanRequest(name, tp, dp)))
            sim = simulate(schedule, BUILTIN["h100"], training=TrainingSetup())
            rows.append((schedule.metrics, sim.get("canzona").step, sim.iteration("canzona").iteration))
        device_aware.MAX_RANK_TASKS = limit
        (off, off_step, off_it), (on, on_step, on_it) = rows
        print(
            f"| {name} | tp{tp} dp{dp} | {off.tp.worst_device_load:.3e} | {on.tp.worst_device_load:.3e} | "
            f"{on.tp.worst_device_load / off.tp.worst_device_load:.3f} | {off.dp.gap:.2%} | {on.dp.gap:.2%} | "
            f"{on.tp.device_gap:.2%} | {off_step * 1e3:.1f} | {on_step * 1e3:.1f} | {off_it * 1e3:.1f} | "
            f"{on_it * 1e3:.1f} |"
        )
    print()


def main() -> None:
    """Print the tables asked for (by default the balance, TP and α tables)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repeat, fewer alpha values")
    parser.add_argument("--scale", action="store_true", help="every preset at 1024 devices")
    parser.add_argument("--startup", action="store_true", help="the CLI's start-up")
    parser.add_argument("--device", action="store_true", help="device-aware DP ownership")
    args = parser.parse_args()
    repeats = 1 if args.quick else 5
    if args.startup:
        startup_table(3 if args.quick else 11)
    if args.device:
        device_table()
    if args.scale:
        scale_table()
    if args.startup or args.device or args.scale:
        return
    balance_table(repeats)
    tp_table(repeats)
    alpha_table([0.0, 0.5, 1.0] if args.quick else ALPHAS)


if __name__ == "__main__":
    main()
