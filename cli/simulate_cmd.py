"""`canzona simulate` and `canzona calibrate` (registered in `canzona.cli.main`).

simulate: predict one optimizer step and one training iteration of a schedule and of every
baseline on a hardware model.
calibrate: time the real kernels with torch on this machine and write a profile.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from canzona.planner.plan import DEFAULT_GLOBAL_BATCH, DEFAULT_SEQ_LEN
from canzona.planner.predict.hardware import CPU_GPUS_PER_NODE
from canzona.planner.predict.simulate import Simulation
from canzona.schedules.files import check_output, write_atomic
from canzona.schedules.limits import bounded_int_problem, settings_problem

MS = 1e3


class CalibrateDevice(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


STEP_FIELDS = ("name", "description", "step", "compute", "comm", "exposed_comm", "dp_comm", "tp_comm", "critical_device")


def simulation_dict(sim: Simulation) -> dict[str, Any]:
    """A simulation as plain data (seconds; ratios are step / canzona's step, and iteration /
    canzona's iteration)."""
    ratios, iteration_ratios = sim.ratios(), sim.iteration_ratios()
    data: dict[str, Any] = {
        "model": sim.model, "tp": sim.tp, "dp": sim.dp, "ep": sim.ep, "optimizer": sim.optimizer,
        "hardware": asdict(sim.hardware), "time_model": sim.time_model, "fused": sim.fused, "rooted": sim.rooted,
        "strategies": [
            {**{key: getattr(s, key) for key in STEP_FIELDS}, "optimizer_stage": s.optimizer_stage, "ratio": ratios[s.name]}
            for s in sim.strategies
        ],
    }
    if sim.training is not None:
        data["training"] = {**asdict(sim.training), "micro_batches": sim.training.validate(sim.dp),
                            "train_flops": sim.hardware.training_flops()}
        data["iterations"] = [{**asdict(it), "ratio": iteration_ratios[it.name]} for it in sim.iterations]
    return data


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *rows])


def _pricing(time_model: str) -> str:
    if time_model == "throughput":
        return "flops model / achieved FLOP/s"
    return f"measured {time_model} (unmeasured shapes scaled by the flops model)"


def _header(sim: Simulation) -> list[str]:
    hw = sim.hardware
    lines = [
        f"{sim.model}  tp {sim.tp} x dp {sim.dp}" + (f" (ep {sim.ep})" if sim.ep > 1 else "")
        + f"  {sim.optimizer}  on {hw.name}",
        f"compute: {_pricing(sim.time_model)}; {hw.matrix_flops / 1e12:.3g} TFLOP/s matrix, "
        f"{hw.memory_bandwidth / 1e9:.3g} GB/s memory",
        f"network: {hw.intra_bandwidth / 1e9:.3g} GB/s intra-node, {hw.inter_bandwidth / 1e9:.3g} GB/s inter-node "
        f"per direction, " + ("all on one host" if hw.gpus_per_node >= CPU_GPUS_PER_NODE else f"{hw.gpus_per_node} per node")
        + f", α {hw.latency * 1e6:.3g} µs per step",
        f"source: {hw.source}",
        "DP collectives: " + ("one fused exchange per buffer" if sim.fused else "one per bucket")
        + ("; canzona's uneven ones as rooted reduces/broadcasts" if sim.rooted else "; canzona's uneven ones as all_to_all"),
    ]
    if sim.training is not None:
        tr, canzona = sim.training, sim.iteration("canzona")
        lines.append(
            f"training: global batch {tr.global_batch} x {tr.seq_len} tokens, {tr.validate(sim.dp)} micro-batches per DP "
            f"rank; forward+backward {hw.training_flops() / 1e12:.3g} TFLOP/s per device (6 x params x tokens); "
            "canzona: gradient reduction " + ("overlapped with backward" if canzona.overlap_grad else "after backward")
            + ", parameter gather " + ("overlapped with the next forward" if canzona.overlap_param else "before the step returns")
        )
    return lines + [""]


def _step_table(sim: Simulation) -> str:
    ratios = sim.ratios()
    header = ["strategy", "step ms", "compute ms", "comm ms", "exposed ms", "DP comm ms", "optimizer ms",
              "vs canzona", "critical device"]
    rows = [
        [s.name, f"{s.step * MS:.3f}", f"{s.compute * MS:.3f}", f"{s.comm * MS:.3f}", f"{s.exposed_comm * MS:.3f}",
         f"{s.dp_comm * MS:.3f}", f"{s.optimizer_stage * MS:.3f}", f"{ratios[s.name]:.2f}x", str(s.critical_device)]
        for s in sim.strategies
    ]
    return _table(header, rows)


def _iteration_table(sim: Simulation) -> str:
    ratios = sim.iteration_ratios()
    header = ["strategy", "iteration ms", "fwd+bwd ms", "exposed reduce ms", "optimizer ms", "exposed gather ms",
              "vs canzona", "overlap (grad, param)"]
    rows = [
        [it.name, f"{it.iteration * MS:.3f}", f"{it.forward_backward * MS:.3f}", f"{it.exposed_reduce * MS:.3f}",
         f"{it.optimizer * MS:.3f}", f"{it.exposed_gather * MS:.3f}", f"{ratios[it.name]:.2f}x",
         f"{'yes' if it.overlap_grad else 'no'}, {'yes' if it.overlap_param else 'no'}"]
        for it in sim.iterations
    ]
    return _table(header, rows)


def simulation_text(sim: Simulation) -> str:
    """The `canzona simulate` report: the optimizer step, then (with a training setup) the iteration."""
    lines = _header(sim) + ["optimizer step (nothing overlapped):", _step_table(sim)]
    lines += ["", "compute/comm/exposed: the critical device's (exposed = step - compute); optimizer = step "
              "without DP collectives."]
    if sim.iterations:
        lines += ["", "training iteration (DP collectives overlapped as each strategy runs them):", _iteration_table(sim),
                  "", "optimizer: fetches + optimizer stage + publishing broadcasts, which nothing overlaps; "
                  "ddp-adamw is a reference (AdamW, not a matrix optimizer)."]
    return "\n".join(lines)


def _check_network(gpus_per_node: int | None, intra_gbps: float | None, inter_gbps: float | None,
                   latency_us: float | None, train_tflops: float | None) -> None:
    from canzona.planner.spec import PlanError

    if gpus_per_node is not None and gpus_per_node < 1:
        raise PlanError(f"gpus per node must be >= 1, got {gpus_per_node}")
    for label, value in (("intra-gbps", intra_gbps), ("inter-gbps", inter_gbps), ("train-tflops", train_tflops)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise PlanError(f"--{label} must be a finite number > 0, got {value}")
    if latency_us is not None and not (latency_us >= 0 and math.isfinite(latency_us)):
        raise PlanError(f"--latency-us must be a finite number >= 0, got {latency_us}")


def simulate(
    file: Annotated[Path, typer.Argument(help="Schedule file.")],
    device: Annotated[str, typer.Option(help="h100, h200, a100, cpu, or a profile file from `canzona calibrate`.")] = "h100",
    intra_gbps: Annotated[Optional[float], typer.Option(help="Intra-node bandwidth, GB/s (gigabytes) per direction per device.")] = None,
    inter_gbps: Annotated[Optional[float], typer.Option(help="Inter-node bandwidth, GB/s (gigabytes) per direction per device.")] = None,
    gpus_per_node: Annotated[Optional[int], typer.Option(help="Devices per node.")] = None,
    latency_us: Annotated[Optional[float], typer.Option(help="α: microseconds per collective step.")] = None,
    fused: Annotated[bool, typer.Option("--fused", help="One DP collective per buffer instead of one per bucket.")] = False,
    dp_collectives: Annotated[str, typer.Option(help="How the runtime does canzona's uneven DP collectives: rooted (its default) or all_to_all.")] = "rooted",
    global_batch: Annotated[int, typer.Option(help="Iteration: sequences per optimizer step, over all DP ranks.")] = DEFAULT_GLOBAL_BATCH,
    seq_len: Annotated[int, typer.Option(help="Iteration: tokens per sequence.")] = DEFAULT_SEQ_LEN,
    micro_batches: Annotated[Optional[int], typer.Option(help="Iteration: forward/backward passes per DP rank (default: global batch / dp).")] = None,
    overlap_grad_reduce: Annotated[bool, typer.Option(help="canzona and TP-SC reduce gradients during backward (the runtime's default).")] = True,
    overlap_param_gather: Annotated[bool, typer.Option(help="canzona and TP-SC gather parameters during the next forward (runtime option).")] = False,
    train_tflops: Annotated[Optional[float], typer.Option(help="Achieved training forward+backward TFLOP/s per device (default: the device model's).")] = None,
    routed_fraction: Annotated[Optional[float], typer.Option(help="MoE: top_k / num_experts (default: from the model's preset or config).")] = None,
    step_only: Annotated[bool, typer.Option("--step-only", help="Predict the optimizer step only, not the iteration.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Predict the optimizer step and the training iteration of the schedule and of every baseline."""
    from dataclasses import replace

    from canzona.planner.partition.costs import OptimizerConfig
    from canzona.planner.plan import TrainingSetup
    from canzona.planner.predict.hardware import resolve_device, shared_host
    from canzona.planner.predict.simulate import simulate as run_simulation
    from canzona.planner.spec import PlanError
    from canzona.schedules.format import read_schedule

    _check_network(gpus_per_node, intra_gbps, inter_gbps, latency_us, train_tflops)
    if dp_collectives not in ("rooted", "all_to_all"):
        raise PlanError(f"--dp-collectives must be rooted or all_to_all, got {dp_collectives!r}")
    schedule = read_schedule(file)
    training = None if step_only else TrainingSetup(global_batch, seq_len, micro_batches)
    if training is not None:
        training.validate(schedule.request.dp)
    chosen = resolve_device(device, intra_gbps, inter_gbps, gpus_per_node, latency_us)
    if train_tflops is not None:
        hw = chosen.hardware
        chosen = replace(chosen, hardware=replace(hw, train_flops=train_tflops * 1e12,
                                                  source=f"{hw.source}; overridden: train_flops={train_tflops:g}e12"))
    if chosen.profile is not None and chosen.profile.device == "cpu":
        # Every rank of a CPU run shares this host: the profile's measured contention applies.
        chosen = shared_host(chosen, schedule.request.tp * schedule.request.dp)
    opt = schedule.request.optimizer
    config = OptimizerConfig(opt.name, opt.ns_steps, opt.block_size, opt.precondition_frequency, opt.max_precond_dim)
    sim = run_simulation(schedule, chosen.hardware, chosen.time_model(config), fused=fused,
                         rooted=dp_collectives == "rooted", training=training, overlap_grad_reduce=overlap_grad_reduce,
                         overlap_param_gather=overlap_param_gather, routed_fraction=routed_fraction)
    typer.echo(json.dumps(simulation_dict(sim), indent=2) if as_json else simulation_text(sim))


def read_shapes(path: Path) -> dict[str, list[tuple[int, int]]]:
    """A shapes file: a YAML/JSON list of [rows, cols] or {rows, cols, optimizers: [...]}
    (default every matrix optimizer). Returns optimizer → shapes."""
    from canzona.planner.partition.costs import OPTIMIZERS
    from canzona.planner.spec import PlanError
    from canzona.schedules.limits import MAX_MODEL_FILE_BYTES
    from canzona.schedules.reading import UnsafeDocument, read_text, safe_load

    try:
        data = safe_load(read_text(path, MAX_MODEL_FILE_BYTES))
    except UnsafeDocument as error:
        raise PlanError(f"cannot read shapes file {str(path)!r}: {error}") from None
    if not isinstance(data, list) or not data:
        raise PlanError(f"{path}: expected a non-empty list of [rows, cols] or {{rows, cols, optimizers}}")
    plan: dict[str, list[tuple[int, int]]] = {name: [] for name in OPTIMIZERS}
    for index, item in enumerate(data):
        if isinstance(item, dict):
            shape, names = (item.get("rows"), item.get("cols")), item.get("optimizers", list(OPTIMIZERS))
        else:
            shape, names = tuple(item) if isinstance(item, list) else (None, None), list(OPTIMIZERS)
        if len(shape) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape):
            raise PlanError(f"{path}: entry {index} is not a shape of two positive integers")
        if not isinstance(names, list) or any(name not in OPTIMIZERS for name in names):
            raise PlanError(f"{path}: entry {index}: optimizers must be a list from {', '.join(OPTIMIZERS)}")
        for name in names:
            plan[name].append((int(shape[0]), int(shape[1])))
    return {name: shapes for name, shapes in plan.items() if shapes}


def model_shapes(model: str) -> list[tuple[int, int]]:
    """Distinct submatrix shapes of a model's matrix-optimizer parameters (full, unsharded)."""
    from canzona.planner.sources.load import load_model
    from canzona.planner.spec import MATRIX

    spec = load_model(model, 1)
    shapes = [s for p in spec.params if p.optimizer == MATRIX for s in p.submatrices]
    return list(dict.fromkeys((int(r), int(c)) for r, c in shapes))


def training_shapes(model: str) -> list[tuple[int, int]]:
    """Full shapes of a model's 2-D parameters (every matmul weight, whichever its optimizer),
    once per parameter, in registration order: what its forward and backward multiply by."""
    from canzona.planner.sources.load import load_model

    return [(p.shape[0], p.shape[1]) for p in load_model(model, 1).params if len(p.shape) == 2]


def grid_shapes(max_side: int) -> list[tuple[int, int]]:
    """A sampled grid: sides 128 .. max_side (powers of 2), aspect ratios 1, 2 and 4."""
    sides = [1 << k for k in range(7, 20) if 1 << k <= max_side]
    return [(a, b) for a in sides for b in sides if a <= b <= 4 * a]


def calibrate(
    output: Annotated[Path, typer.Option("--output", "-o", help="Profile file to write.")],
    device: Annotated[CalibrateDevice, typer.Option(help="Where to time the kernels.")] = CalibrateDevice.cpu,
    model: Annotated[Optional[str], typer.Option(help="Time this model's distinct matrix shapes (preset or file).")] = None,
    shapes: Annotated[Optional[Path], typer.Option(help="YAML/JSON list of [rows, cols] or {rows, cols, optimizers}.")] = None,
    optimizer: Annotated[Optional[list[str]], typer.Option(help="Matrix optimizer(s) to time (default all three).")] = None,
    repeats: Annotated[int, typer.Option(help="Timed repeats per kernel (median).")] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed warm-up calls per kernel.")] = 2,
    threads: Annotated[Optional[int], typer.Option(help="torch CPU threads (default: torch's choice).")] = None,
    comm_ranks: Annotated[int, typer.Option(help="Also fit gloo all-to-all among this many local processes (0: no).")] = 0,
    train_tokens: Annotated[int, typer.Option(help="Also time training forward+backward on this many tokens (0: no): one matmul per 2-D weight of --model, else per timed shape.")] = 0,
    max_side: Annotated[int, typer.Option(help="Largest side of the default grid.")] = 1024,
    ns_steps: Annotated[int, typer.Option(help="Muon Newton-Schulz steps.")] = 5,
    block_size: Annotated[int, typer.Option(help="Shampoo block size.")] = 1024,
    precondition_frequency: Annotated[int, typer.Option(help="Shampoo/SOAP refresh every N steps.")] = 10,
    max_precond_dim: Annotated[int, typer.Option(help="SOAP: sides above this get no preconditioner.")] = 10000,
) -> None:
    """Time Newton-Schulz, Shampoo, SOAP and AdamW with torch on this device; write a profile
    for `plan --cost profile:FILE` and `simulate --device FILE`."""
    from canzona.planner.partition.costs import OPTIMIZERS
    from canzona.planner.predict.profile_cost import Profile, dump_profile
    from canzona.planner.spec import PlanError

    if model is not None and shapes is not None:
        raise PlanError("give --model or --shapes, not both")
    problem = calibrate_problem(repeats, warmup, threads, comm_ranks, max_side,
                                (ns_steps, block_size, precondition_frequency, max_precond_dim))
    if problem:
        raise PlanError(problem)
    if train_tokens < 0:
        raise PlanError(f"--train-tokens must be >= 0, got {train_tokens}")
    check_output(output, [shapes, model], "--output")
    names = optimizer or list(OPTIMIZERS)
    unknown = [name for name in names if name not in OPTIMIZERS]
    if unknown:
        raise PlanError(f"unknown optimizer {unknown[0]!r}; choose from {', '.join(OPTIMIZERS)}")
    if shapes is not None:
        plan = {name: todo for name, todo in read_shapes(shapes).items() if name in names}
    else:
        todo = model_shapes(model) if model is not None else grid_shapes(max_side)
        plan = {name: todo for name in names}
    if not plan:
        raise PlanError("nothing to time: no shape is asked for with the chosen optimizers")
    train = (training_shapes(model) if model is not None else list(dict.fromkeys(s for todo in plan.values() for s in todo)),
             train_tokens)
    profile = _run_calibration(plan, device.value, repeats, warmup, threads, comm_ranks,
                               (ns_steps, block_size, precondition_frequency, max_precond_dim), train)
    validated = Profile.model_validate(profile)
    write_atomic(output, dump_profile(validated))
    typer.echo(f"wrote {output}: {len(validated.rows)} rows on {validated.device_name}")


MAX_REPEATS = 1000
MAX_COMM_RANKS = 64  # local processes (the contention probe runs twice as many)
MAX_GRID_SIDE = 16384  # a 16384 x 16384 fp32 matrix is 1 GiB


def calibrate_problem(repeats: int, warmup: int, threads: int | None, comm_ranks: int, max_side: int,
                      settings: tuple[int, int, int, int]) -> str | None:
    """What is wrong with `calibrate`'s arguments, found before any timing (None: nothing)."""
    cpus = os.cpu_count() or 1
    return (
        bounded_int_problem("--repeats", repeats, MAX_REPEATS, "repeats")
        or bounded_int_problem("--warmup", warmup, MAX_REPEATS, "calls", minimum=0)
        or (bounded_int_problem("--threads", threads, cpus, f"threads (this machine has {cpus} CPUs)")
            if threads is not None else None)
        or (f"--comm-ranks must be 0 or >= 2, got {comm_ranks}" if comm_ranks == 1 or comm_ranks < 0 else None)
        or bounded_int_problem("--comm-ranks", comm_ranks, MAX_COMM_RANKS, "local processes", minimum=0)
        or bounded_int_problem("--max-side", max_side, MAX_GRID_SIDE, "rows or columns", minimum=128)
        or settings_problem("muon", *settings)
    )


def _run_calibration(plan: dict[str, list[tuple[int, int]]], device: str, repeats: int, warmup: int,
                     threads: int | None, comm_ranks: int, settings: tuple[int, int, int, int],
                     train: tuple[list[tuple[int, int]], int] = ([], 0)) -> dict[str, Any]:
    from canzona.planner.spec import PlanError

    try:
        from canzona.runtime.calibrate import Settings
        from canzona.runtime.calibrate import calibrate as run
    except ImportError as error:  # torch is an optional dependency of the planner CLI
        raise PlanError(f"calibrate needs torch (pip install 'canzona[runtime]'): {error}") from error
    try:
        return run([], Settings(*settings), device, repeats, warmup, plan, threads=threads, comm_ranks=comm_ranks,
                   progress=lambda line: typer.echo(line, err=True), train_shapes=train[0], train_tokens=train[1])
    except ValueError as error:
        raise PlanError(str(error)) from error
