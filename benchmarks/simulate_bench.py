"""Simulator benchmark: predicted optimizer step of canzona vs every baseline, planning scale,
and the CPU cross-check against the runtime benchmark.

Run:  python benchmarks/simulate_bench.py --paper        Qwen3 1.7B-32B at 256 GPUs on the H100 model
      python benchmarks/simulate_bench.py --scale        plan + simulate time and peak memory, MoE presets
      python benchmarks/simulate_bench.py --cpu [--repeats N] [--quick]
                                                         predicted vs measured (benchmarks/runtime_step.py)
      python benchmarks/simulate_bench.py                --paper and --scale

Every figure comes from plans built in this run. --cpu needs torch (it runs the runtime).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.predict.auto_alpha import choose_alpha
from canzona.planner.predict.hardware import BUILTIN, resolve_device, shared_host
from canzona.planner.predict.simulate import Simulation, simulate
from canzona.planner.sources.load import load_model
from canzona.schedules.format import Schedule, read_schedule, write_schedule

PAPER_MODELS = ["qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"]
PAPER_LAYOUTS = [(8, 32), (4, 64)]
BASELINES = ["canzona-no-overlap", "tp-sc", "dp-sc", "zero1-gather", "start-owner", "layer-wise"]
SCALE = [("qwen3-235b-a22b", 4, dp, 8) for dp in (64, 256, 1024)] + [("deepseek-v3", 4, dp, 8) for dp in (64, 256, 1024)]
# Every preset at 1024 devices: dense ones tp 8 x dp 128, MoE ones (tp <= 4) tp 4 x dp 256 with ep 8.
DENSE = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b",
         "llama3.1-8b", "llama3.1-70b", "llama3.1-405b"]
PRESET_SCALE = [(name, 8, 128, 1) for name in DENSE] + [
    ("mixtral-8x7b", 8, 128, 8), ("qwen3-30b-a3b", 4, 256, 8), ("qwen3-235b-a22b", 4, 256, 8), ("deepseek-v3", 4, 256, 8)
]
WHOLE_BUFFER = 1 << 40  # one bucket per buffer (Megatron without overlap_grad_reduce)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def paper_rows(bucket_size: int, auto: bool, rooted: bool = False) -> list[tuple[str, int, int, float, Simulation]]:
    """Plan every Qwen3 model and layout (α chosen by the simulator when `auto`) and simulate."""
    hardware, rows = BUILTIN["h100"], []
    for name in PAPER_MODELS:
        for tp, dp in PAPER_LAYOUTS:
            model = load_model(name, tp)
            request = PlanRequest(name, tp, dp, bucket_size=bucket_size)
            plan = choose_alpha(model, request, hardware, rooted=rooted)[0] if auto else make_plan(model, request)
            rows.append((name, tp, dp, plan.request.alpha, simulate(compile_schedule(plan), hardware, rooted=rooted)))
    return rows


def paper_table(bucket_size: int, auto: bool, rooted: bool = False) -> None:
    """Per model and layout: canzona's predicted optimizer stage and full step, and every
    baseline's ratio to it (optimizer stage / full step)."""
    label = "default 40M-element buckets" if bucket_size != WHOLE_BUFFER else "one bucket per buffer"
    label += (", canzona's uneven DP collectives as rooted reduces/broadcasts (runtime option dp_collectives=\"rooted\")"
              if rooted else "")
    print(f"### Qwen3 at 256 GPUs, H100 model, Muon, {label}" + (", alpha auto" if auto else "") + "\n")
    print("Cells: baseline / canzona for the optimizer stage (no DP collectives) and, after the slash, "
          "for the full step (DP reduce-scatter + optimizer + all-gather).\n")
    header = ["model", "layout", "alpha", "canzona opt. ms", "canzona step ms"] + BASELINES
    print(_row(header))
    print("|" + "---|" * len(header))
    for name, tp, dp, alpha, sim in paper_rows(bucket_size, auto, rooted):
        canzona = sim.get("canzona")
        cells = [f"{sim.get(b).optimizer_stage / canzona.optimizer_stage:.2f}x / {sim.get(b).step / canzona.step:.2f}x"
                 for b in BASELINES]
        print(_row([name, f"tp{tp} dp{dp}", f"{alpha:g}", f"{canzona.optimizer_stage * 1e3:.1f}",
                    f"{canzona.step * 1e3:.1f}", *cells]))
    print()


def scale_one(name: str, tp: int, dp: int, ep: int) -> dict[str, float]:
    """Plan, write, read and simulate one preset in this process; seconds and peak RSS."""
    times: dict[str, float] = {}
    started = time.perf_counter()
    schedule = compile_schedule(make_plan(load_model(name, tp), PlanRequest(name, tp, dp, ep=ep)))
    times["plan_s"] = time.perf_counter() - started
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "schedule.yaml"
        started = time.perf_counter()
        write_schedule(schedule, path)
        times["write_s"] = time.perf_counter() - started
        times["file_mb"] = path.stat().st_size / 1e6
        started = time.perf_counter()
        loaded = read_schedule(path)
        times["read_s"] = time.perf_counter() - started
    started = time.perf_counter()
    simulate(loaded, BUILTIN["h100"])
    times["simulate_s"] = time.perf_counter() - started
    times["peak_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return times


def scale_table(layouts: list[tuple[str, int, int, int]] = SCALE) -> None:
    """Each preset in a fresh process, so its peak memory is its own."""
    print("### Planning scale (plan = load + plan + compile; peak = max RSS of the process)\n")
    header = ["preset", "layout", "plan s", "write s", "read s", "simulate s", "total s", "peak MiB", "file MB"]
    print(_row(header))
    print("|" + "---|" * len(header))
    for name, tp, dp, ep in layouts:
        output = subprocess.run([sys.executable, __file__, "--one", name, str(tp), str(dp), str(ep)],
                                check=True, capture_output=True, text=True).stdout
        t = json.loads(output)
        total = t["plan_s"] + t["write_s"] + t["read_s"] + t["simulate_s"]
        print(_row([name, f"tp{tp} dp{dp} ep{ep}", f"{t['plan_s']:.2f}", f"{t['write_s']:.2f}", f"{t['read_s']:.2f}",
                    f"{t['simulate_s']:.2f}", f"{total:.2f}", f"{t['peak_mib']:.0f}", f"{t['file_mb']:.1f}"]))
    print()


# --------------------------------------------------------------------------------------------
# CPU cross-check


def cpu_predictions(schedule: Schedule) -> dict[str, float]:
    """Predicted step seconds of canzona, TP-SC and DP-SC for a runtime-benchmark schedule on
    this CPU: the checked-in profile (one thread per rank), its measured contention for this
    many ranks, its gloo fit, and the runtime's execution (one fused DP exchange, fp32)."""
    world = schedule.request.dp * schedule.request.tp
    device = shared_host(resolve_device("cpu"), world)
    opt = schedule.request.optimizer
    config = OptimizerConfig(opt.name, opt.ns_steps, opt.block_size, opt.precondition_frequency, opt.max_precond_dim)
    sim = simulate(schedule, device.hardware, device.time_model(config), fused=True, publish_bytes=4)
    return {name: sim.get(name).step for name in ("canzona", "tp-sc", "dp-sc")}


def cpu_table(repeats: int, quick: bool, optimizer: str) -> None:
    """Run benchmarks/runtime_step.py's layouts `repeats` times and the simulator once; print both."""
    sys.path.insert(0, str(Path(__file__).parent))
    import runtime_step  # noqa: PLC0415 - needs torch; only this section does

    warmup, steps = (2, 3) if quick else (3, 9)
    print(f"### CPU cross-check: predicted vs measured ({optimizer}, runtime_step.py layouts, "
          f"median of {repeats} run(s) of {steps} timed steps)\n")
    header = ["layout", "measured canzona / TP-SC / DP-SC ms", "predicted ms", "measured DP-SC/c, TP-SC/c",
              "predicted DP-SC/c, TP-SC/c", "ratio error"]
    print(_row(header))
    print("|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "bench_qwen3.json"
        config.write_text(json.dumps(runtime_step.MODEL))
        for dp, tp in runtime_step.LAYOUTS:
            schedule = runtime_step.make_schedule(str(config), dp, tp, optimizer, 1.0)
            runs = [runtime_step.run_layout(schedule, warmup, steps) for _ in range(repeats)]
            measured = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            predicted = cpu_predictions(schedule)
            m_ratio = [measured[k] / measured["canzona"] for k in ("dp-sc", "tp-sc")]
            p_ratio = [predicted[k] / predicted["canzona"] for k in ("dp-sc", "tp-sc")]
            error = [p / m - 1 for p, m in zip(p_ratio, m_ratio)]
            print(_row([f"DP {dp} x TP {tp}", " / ".join(f"{measured[k] * 1e3:.0f}" for k in ("canzona", "tp-sc", "dp-sc")),
                        " / ".join(f"{predicted[k] * 1e3:.0f}" for k in ("canzona", "tp-sc", "dp-sc")),
                        ", ".join(f"{r:.2f}" for r in m_ratio), ", ".join(f"{r:.2f}" for r in p_ratio),
                        ", ".join(f"{100 * e:+.0f}%" for e in error)]))
            sys.stdout.flush()
    print()


def main() -> None:
    """Parse arguments and print the asked tables."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paper", action="store_true")
    parser.add_argument("--scale", action="store_true")
    parser.add_argument("--presets", action="store_true", help="scale table for every preset at 1024 devices")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="--cpu: runs of the runtime benchmark (median)")
    parser.add_argument("--quick", action="store_true", help="--cpu: fewer timed steps")
    parser.add_argument("--optimizer", default="muon", choices=["muon", "shampoo", "soap"])
    parser.add_argument("--one", nargs=4, metavar=("PRESET", "TP", "DP", "EP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        name, tp, dp, ep = args.one
        print(json.dumps(scale_one(name, int(tp), int(dp), int(ep))))
        return
    everything = not (args.paper or args.scale or args.cpu or args.presets)
    if args.paper or everything:
        paper_table(40_000_000, auto=True)
        paper_table(WHOLE_BUFFER, auto=True)
        paper_table(40_000_000, auto=True, rooted=True)
    if args.scale or everything:
        scale_table()
    if args.presets or everything:
        scale_table(PRESET_SCALE)
    if args.cpu:
        cpu_table(args.repeats, args.quick, args.optimizer)


if __name__ == "__main__":
    main()
