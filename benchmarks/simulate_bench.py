"""Simulator benchmark: predicted optimizer step and training iteration of canzona vs every
baseline at 256 GPUs, the bucket size (Megatron's 40M, the authors' 400M, `auto`), planning
scale, and the CPU cross-check against the runtime benchmark.

Run:  python benchmarks/simulate_bench.py --paper        Qwen3 1.7B-32B at 256 GPUs, H100 model, defaults
      python benchmarks/simulate_bench.py --batch        qwen3-32b tp8 dp32: global batch and gather overlap
      python benchmarks/simulate_bench.py --buckets      40M vs 400M vs auto
      python benchmarks/simulate_bench.py --layouts      Qwen3 and Llama (and MoE) layouts at 256 GPUs
      python benchmarks/simulate_bench.py --scale        plan + simulate time and peak memory, MoE presets
      python benchmarks/simulate_bench.py --cpu [--repeats N] [--quick]
                                                         predicted vs measured (benchmarks/runtime_step.py)
      python benchmarks/simulate_bench.py                --paper, --batch, --buckets and --layouts

Every figure comes from plans built in this run, with the simulator's defaults unless a column
says otherwise: each bucket's DP collective as the schedule records it, gradient reduction
overlapped with backward and no gather overlap for every strategy, global batch 256 x 4096
tokens, one sequence per micro-batch. --cpu needs torch.
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
from pathlib import Path

from canzona.planner.compile import compile_schedule
from canzona.planner.partition.costs import OptimizerConfig
from canzona.planner.plan import PlanRequest, TrainingSetup, make_plan
from canzona.planner.predict.auto_bucket import choose_bucket_size, size_label
from canzona.planner.predict.hardware import BUILTIN, resolve_device, shared_host
from canzona.planner.predict.sim_baselines import REFERENCES
from canzona.planner.predict.simulate import simulate
from canzona.planner.sources.load import load_model
from canzona.schedules.format import Schedule, read_schedule, write_schedule

PAPER_MODELS = ["qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"]
PAPER_LAYOUTS = [(8, 32), (4, 64)]
BASELINES = ["tp-sc", "dp-sc", "zero1-gather", "start-owner", "layer-wise"]
LAYOUTS_256 = [(name, tp, dp, 1) for name in PAPER_MODELS for tp, dp in PAPER_LAYOUTS] + [
    ("qwen3-0.6b", 1, 256, 1),
    ("qwen3-1.7b", 2, 128, 1),
    ("qwen3-4b", 2, 128, 1),
    ("llama3.1-8b", 8, 32, 1),
    ("llama3.1-8b", 4, 64, 1),
    ("llama3.1-70b", 8, 32, 1),
    ("qwen3-30b-a3b", 4, 64, 8),
    ("qwen3-235b-a22b", 4, 64, 8),
]
BUCKET_LAYOUTS = [(name, tp, dp) for name in PAPER_MODELS for tp, dp in PAPER_LAYOUTS] + [
    ("llama3.1-8b", 8, 32),
    ("llama3.1-70b", 8, 32),
]
SCALE = [("qwen3-235b-a22b", 4, dp, 8) for dp in (64, 256, 1024)] + [
    ("deepseek-v3", 4, dp, 8) for dp in (64, 256, 1024)
]
# Every preset at 1024 devices: dense ones tp 8 x dp 128, MoE ones (tp <= 4) tp 4 x dp 256 with ep 8.
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
PRESET_SCALE = [(name, 8, 128, 1) for name in DENSE] + [
    ("mixtral-8x7b", 8, 128, 8),
    ("qwen3-30b-a3b", 4, 256, 8),
    ("qwen3-235b-a22b", 4, 256, 8),
    ("deepseek-v3", 4, 256, 8),
]
H100 = BUILTIN["h100"]


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _header(cells: list[str]) -> None:
    print(_row(cells))
    print("|" + "---|" * len(cells))


def default_schedule(name: str, tp: int, dp: int, ep: int = 1) -> Schedule:
    """The schedule `canzona plan` writes with its defaults for this layout."""
    return compile_schedule(make_plan(load_model(name, tp), PlanRequest(name, tp, dp, ep=ep)))


def paper_table() -> None:
    """Per Qwen3 model and layout: canzona's predicted step and iteration, and every
    baseline's ratio to them (step / iteration)."""
    print("### Qwen3 at 256 GPUs, H100 model, Muon, `canzona plan` and `canzona simulate` defaults\n")
    print(
        "Cells: baseline / canzona for the optimizer step (nothing overlapped), then for the training "
        "iteration (every strategy's DP collectives overlapped alike: reductions with backward, gathers not). "
        "The paper (arXiv 2602.06079): 5.8x optimizer step, 1.57x iteration at 32B.\n"
    )
    _header(["model", "layout", "canzona step ms", "canzona iteration ms", *BASELINES, "ddp-adamw (ref.)"])
    for name in PAPER_MODELS:
        for tp, dp in PAPER_LAYOUTS:
            sim = simulate(default_schedule(name, tp, dp), H100, training=TrainingSetup())
            step, it = sim.ratios(), sim.iteration_ratios()
            cells = [f"{step[b]:.2f}x / {it[b]:.2f}x" for b in [*BASELINES, "ddp-adamw"]]
            print(
                _row(
                    [
                        name,
                        f"tp{tp} dp{dp}",
                        f"{sim.get('canzona').step * 1e3:.1f}",
                        f"{sim.iteration('canzona').iteration * 1e3:.1f}",
                        *cells,
                    ]
                )
            )
    print()


def batch_table() -> None:
    """qwen3-32b tp8 dp32 (the library schedule): how the iteration speedups move with the
    global batch and with canzona's parameter-gather overlap."""
    schedule = read_schedule(Path(__file__).resolve().parents[1] / "schedules/qwen3-32b/muon-tp8-dp32.yaml")
    print(
        "### qwen3-32b tp8 dp32 (library schedule): iteration by global batch (4096-token sequences, "
        "one per micro-batch)\n"
    )
    print("Cells: baseline iteration / canzona iteration.\n")
    _header(
        [
            "global batch",
            "gather overlap",
            "canzona iteration ms",
            "fwd+bwd ms",
            "exposed reduce ms",
            "optimizer ms",
            "exposed gather ms",
            *BASELINES,
        ]
    )
    for batch in (64, 256, 1024):
        for overlap in (False, True):
            sim = simulate(schedule, H100, training=TrainingSetup(global_batch=batch), overlap_param_gather=overlap)
            it, ratios = sim.iteration("canzona"), sim.iteration_ratios()
            print(
                _row(
                    [
                        str(batch),
                        "on" if overlap else "off",
                        f"{it.iteration * 1e3:.1f}",
                        f"{it.forward_backward * 1e3:.1f}",
                        f"{it.exposed_reduce * 1e3:.1f}",
                        f"{it.optimizer * 1e3:.1f}",
                        f"{it.exposed_gather * 1e3:.1f}",
                        *[f"{ratios[b]:.2f}x" for b in BASELINES],
                    ]
                )
            )
    print()


def bucket_table() -> None:
    """Per layout: canzona's predicted iteration (and step) at Megatron's 40M, the authors'
    400M and `--bucket-size auto`'s choice."""
    print("### Bucket size: Megatron's 40M, the authors' 400M, `--bucket-size auto` (H100 model, defaults)\n")
    print(
        "Cells: predicted iteration ms (step ms) and matrix buckets. auto picks the fastest predicted "
        "iteration among 10M, 20M, 40M, 100M, 200M, 400M and one bucket that keeps >= 2 matrix buckets.\n"
    )
    _header(["model", "layout", "40M", "400M", "one bucket", "auto", "auto vs 40M", "auto vs 400M"])
    for name, tp, dp in BUCKET_LAYOUTS:
        model = load_model(name, tp)
        plan, trials, _ = choose_bucket_size(model, PlanRequest(name, tp, dp), H100)
        by_size = {int(t.value): t for t in trials}
        chosen = by_size[plan.request.bucket_size]

        def cell(t) -> str:
            return f"{t.iteration_s * 1e3:.1f} ({t.step_s * 1e3:.1f}), {t.num_buckets}"

        print(
            _row(
                [
                    name,
                    f"tp{tp} dp{dp}",
                    cell(by_size[40_000_000]),
                    cell(by_size[400_000_000]),
                    cell(trials[-1]),
                    f"{size_label(plan.request.bucket_size)}: {cell(chosen)}",
                    f"{by_size[40_000_000].iteration_s / chosen.iteration_s:.4f}x",
                    f"{by_size[400_000_000].iteration_s / chosen.iteration_s:.4f}x",
                ]
            )
        )
    print()


def layouts_table() -> None:
    """The done-when check: default plans at 256 GPUs; the closest baseline for the step and
    for the iteration (ratio > 1: canzona faster)."""
    print("### Default plans at 256 GPUs: canzona against its closest baseline (H100 model, defaults)\n")
    _header(
        [
            "model",
            "layout",
            "canzona step ms",
            "closest baseline (step)",
            "canzona iteration ms",
            "closest baseline (iteration)",
        ]
    )
    for name, tp, dp, ep in LAYOUTS_256:
        sim = simulate(default_schedule(name, tp, dp, ep), H100, training=TrainingSetup())
        others = [s.name for s in sim.strategies if s.name not in (*REFERENCES, "canzona")]
        step, it = sim.ratios(), sim.iteration_ratios()
        closest_step, closest_it = min(others, key=step.__getitem__), min(others, key=it.__getitem__)
        print(
            _row(
                [
                    name,
                    f"tp{tp} dp{dp}" + (f" ep{ep}" if ep > 1 else ""),
                    f"{sim.get('canzona').step * 1e3:.1f}",
                    f"{closest_step} {step[closest_step]:.3f}x",
                    f"{sim.iteration('canzona').iteration * 1e3:.1f}",
                    f"{closest_it} {it[closest_it]:.3f}x",
                ]
            )
        )
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
        output = subprocess.run(
            [sys.executable, __file__, "--one", name, str(tp), str(dp), str(ep)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        t = json.loads(output)
        total = t["plan_s"] + t["write_s"] + t["read_s"] + t["simulate_s"]
        print(
            _row(
                [
                    name,
                    f"tp{tp} dp{dp} ep{ep}",
                    f"{t['plan_s']:.2f}",
                    f"{t['write_s']:.2f}",
                    f"{t['read_s']:.2f}",
                    f"{t['simulate_s']:.2f}",
                    f"{total:.2f}",
                    f"{t['peak_mib']:.0f}",
                    f"{t['file_mb']:.1f}",
                ]
            )
        )
    print()


# --------------------------------------------------------------------------------------------
# CPU cross-check


def cpu_predictions(schedule: Schedule) -> dict[str, float]:
    """Predicted step seconds of canzona, TP-SC and DP-SC for a runtime-benchmark schedule on
    this CPU: the checked-in profile (one thread per rank), its measured contention for this
    many ranks, its gloo fit, and the runtime's execution (per bucket, the collective the schedule
    records: the default; fp32 gathers)."""
    world = schedule.request.dp * schedule.request.tp
    device = shared_host(resolve_device("cpu"), world)
    opt = schedule.request.optimizer
    config = OptimizerConfig(**opt.model_dump())
    sim = simulate(schedule, device.hardware, device.time_model(config), publish_bytes=4)
    return {name: sim.get(name).step for name in ("canzona", "tp-sc", "dp-sc")}


def cpu_table(repeats: int, quick: bool, optimizer: str) -> None:
    """Run benchmarks/runtime_step.py's layouts `repeats` times and the simulator once; print both."""
    sys.path.insert(0, str(Path(__file__).parent))
    import runtime_step

    warmup, steps = (2, 3) if quick else (3, 9)
    print(
        f"### CPU cross-check: predicted vs measured ({optimizer}, runtime_step.py layouts, "
        f"median of {repeats} run(s) of {steps} timed steps)\n"
    )
    header = [
        "layout",
        "measured canzona / TP-SC / DP-SC ms",
        "predicted ms",
        "measured DP-SC/c, TP-SC/c",
        "predicted DP-SC/c, TP-SC/c",
        "ratio error",
    ]
    print(_row(header))
    print("|" + "---|" * len(header))
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "bench_qwen3.json"
        config.write_text(json.dumps(runtime_step.MODEL))
        for dp, tp, _ in runtime_step.LAYOUTS["dense"]:
            schedule = runtime_step.make_schedule(str(config), dp, tp, optimizer, 1.0)
            runs = [runtime_step.run_layout(schedule, warmup, steps) for _ in range(repeats)]
            measured = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
            predicted = cpu_predictions(schedule)
            m_ratio = [measured[k] / measured["canzona"] for k in ("dp-sc", "tp-sc")]
            p_ratio = [predicted[k] / predicted["canzona"] for k in ("dp-sc", "tp-sc")]
            error = [p / m - 1 for p, m in zip(p_ratio, m_ratio)]
            print(
                _row(
                    [
                        f"DP {dp} x TP {tp}",
                        " / ".join(f"{measured[k] * 1e3:.0f}" for k in ("canzona", "tp-sc", "dp-sc")),
                        " / ".join(f"{predicted[k] * 1e3:.0f}" for k in ("canzona", "tp-sc", "dp-sc")),
                        ", ".join(f"{r:.2f}" for r in m_ratio),
                        ", ".join(f"{r:.2f}" for r in p_ratio),
                        ", ".join(f"{100 * e:+.0f}%" for e in error),
                    ]
                )
            )
            sys.stdout.flush()
    print()


def main() -> None:
    """Parse arguments and print the asked tables."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("paper", "batch", "buckets", "layouts", "scale", "presets", "cpu"):
        parser.add_argument(f"--{flag}", action="store_true")
    parser.add_argument("--repeats", type=int, default=1, help="--cpu: runs of the runtime benchmark (median)")
    parser.add_argument("--quick", action="store_true", help="--cpu: fewer timed steps")
    parser.add_argument("--optimizer", default="muon", choices=["muon", "shampoo", "soap"])
    parser.add_argument("--one", nargs=4, metavar=("PRESET", "TP", "DP", "EP"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        name, tp, dp, ep = args.one
        print(json.dumps(scale_one(name, int(tp), int(dp), int(ep))))
        return
    everything = not any(
        getattr(args, flag) for flag in ("paper", "batch", "buckets", "layouts", "scale", "presets", "cpu")
    )
    for flag, table in (
        ("paper", paper_table),
        ("batch", batch_table),
        ("buckets", bucket_table),
        ("layouts", layouts_table),
    ):
        if getattr(args, flag) or everything:
            table()
            sys.stdout.flush()
    if args.scale:
        scale_table()
    if args.presets:
        scale_table(PRESET_SCALE)
    if args.cpu:
        cpu_table(args.repeats, args.quick, args.optimizer)


if __name__ == "__main__":
    main()
