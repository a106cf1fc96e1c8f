"""`canzona calibrate` (registered in `canzona.cli.main`): time the real optimizer kernels with
torch on this machine and write a profile for `plan --cost profile:FILE` and
`simulate --device profile:FILE`.

Every argument and the output path are checked before any timing. Then the command says how
many kernels it will time and about how long that takes (from this machine's speed on one small
Muon kernel), and shows "n of N" progress on stderr while it runs.
"""

from __future__ import annotations

import os
import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from canzona.cli.options import output_path, refuse_unless, refuse_unused_settings, write_output
from canzona.cli.progress import note, progress
from canzona.cli.wording import duration, echo, plural
from canzona.planner.spec import PlanError
from canzona.schedules.files import check_output
from canzona.schedules.limits import bounded_int_problem, settings_problem

MAX_REPEATS = 1000
MAX_COMM_RANKS = 64  # local processes (the contention probe runs twice as many)
MAX_GRID_SIDE = 16384  # a 16384 x 16384 fp32 matrix is 1 GiB
# --quick: one timed call per kernel, and every shape at most 512 on a side (the grid's largest;
# a model's or a shapes file's shapes scaled down), so that a 2-core CPU is done in seconds.
QUICK = {"repeats": 1, "warmup": 1, "max_side": 512}
PROBE_SIDE = 512  # the Muon kernel timed first to estimate the whole run
TIMED_TWICE = ("shampoo", "soap")  # timed on a refreshing step and on a plain one

Settings = tuple[int, int, int, int]  # ns_steps, block_size, precondition_frequency, max_precond_dim


class TorchDevice(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


def read_shapes(path: Path) -> dict[str, list[tuple[int, int]]]:
    """A shapes file: a YAML/JSON list of [rows, cols] or {rows, cols, optimizers: [...]}
    (default every matrix optimizer). Returns optimizer → shapes."""
    from canzona.planner.partition.costs import OPTIMIZERS
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
        sides = [v for v in shape if isinstance(v, int) and not isinstance(v, bool) and v >= 1]
        if len(shape) != 2 or len(sides) != 2:
            raise PlanError(f"{path}: entry {index} is not a shape of two positive integers")
        if not isinstance(names, list) or any(name not in OPTIMIZERS for name in names):
            raise PlanError(f"{path}: entry {index}: optimizers must be a list from {', '.join(OPTIMIZERS)}")
        for name in names:
            plan[name].append((sides[0], sides[1]))
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


def scaled_shapes(shapes: list[tuple[int, int]], max_side: int) -> list[tuple[int, int]]:
    """`shapes` scaled down, aspect ratio kept, until the longer side is at most `max_side`
    (smaller shapes unchanged); distinct, in order. A profile prices the full shapes from these
    by FLOP rate (`ProfileCost`)."""
    scaled = []
    for rows, cols in shapes:
        factor = min(1.0, max_side / max(rows, cols))
        scaled.append((max(1, round(rows * factor)), max(1, round(cols * factor))))
    return list(dict.fromkeys(scaled))


def grid_shapes(max_side: int) -> list[tuple[int, int]]:
    """A sampled grid: sides 128 .. max_side (powers of 2), aspect ratios 1, 2 and 4."""
    sides = [1 << k for k in range(7, 20) if 1 << k <= max_side]
    return [(a, b) for a in sides for b in sides if a <= b <= 4 * a]


def calibrate(
    output: Annotated[str, typer.Option("--output", "-o", metavar="FILE", help="Profile file to write.")],
    torch_device: Annotated[
        TorchDevice, typer.Option(help="Where torch runs the kernels (a torch device, not a hardware model).")
    ] = TorchDevice.cpu,
    model: Annotated[
        str | None, typer.Option(help="Time this model's distinct matrix shapes (preset or file).")
    ] = None,
    shapes: Annotated[
        Path | None, typer.Option(help="YAML/JSON list of [rows, cols] or {rows, cols, optimizers}.")
    ] = None,
    optimizer: Annotated[
        list[str] | None, typer.Option(help="Matrix optimizer(s) to time (default all three).")
    ] = None,
    quick: Annotated[
        bool,
        typer.Option(
            "--quick",
            help=(
                "A rough profile in seconds: one timed call per kernel after one warm-up, every shape at most 512 on "
                "a side (a model's or a shapes file's scaled down, aspect kept)."
            ),
        ),
    ] = False,
    repeats: Annotated[int, typer.Option(help="Timed repeats per kernel (median).")] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed warm-up calls per kernel.")] = 2,
    threads: Annotated[int | None, typer.Option(help="torch CPU threads (default: torch's choice).")] = None,
    comm_ranks: Annotated[
        int, typer.Option(help="Also fit gloo all-to-all among this many local processes (0: no).")
    ] = 0,
    train_tokens: Annotated[
        int,
        typer.Option(
            help=(
                "Also time training forward+backward on this many tokens (0: no): one matmul per 2-D weight of "
                "--model, else per timed shape."
            )
        ),
    ] = 0,
    max_side: Annotated[
        int, typer.Option(help="Largest side of the default grid (without --model or --shapes).")
    ] = 1024,
    ns_steps: Annotated[int, typer.Option(help="Muon Newton-Schulz steps.")] = 5,
    block_size: Annotated[int, typer.Option(help="Shampoo block size.")] = 1024,
    precondition_frequency: Annotated[int, typer.Option(help="Shampoo/SOAP refresh every N steps.")] = 10,
    max_precond_dim: Annotated[int, typer.Option(help="SOAP: sides above this get no preconditioner.")] = 10000,
) -> None:
    """Time Newton-Schulz, Shampoo, SOAP and AdamW with torch on this machine; write a profile
    for `plan --cost profile:FILE` and `simulate --device profile:FILE`."""
    from canzona.planner.partition.costs import OPTIMIZERS

    target = output_path(output)
    if model is not None and shapes is not None:
        raise PlanError("give --model or --shapes, not both")
    refuse_unless(not quick, ("repeats", "warmup", "max_side"), "--quick sets it")
    refuse_unless(
        model is None and shapes is None, ("max_side",), "it sizes the default grid, which --model or --shapes replaces"
    )
    if quick:
        repeats, warmup, max_side = QUICK["repeats"], QUICK["warmup"], QUICK["max_side"]
    settings = (ns_steps, block_size, precondition_frequency, max_precond_dim)
    problem = calibrate_problem(repeats, warmup, threads, comm_ranks, max_side, settings)
    if problem:
        raise PlanError(problem)
    if train_tokens < 0:
        raise PlanError(f"--train-tokens must be >= 0, got {train_tokens}")
    check_output(target, [shapes, model], "--output")
    names = optimizer or list(OPTIMIZERS)
    unknown = [name for name in names if name not in OPTIMIZERS]
    if unknown:
        raise PlanError(f"unknown optimizer {unknown[0]!r}; choose from {', '.join(OPTIMIZERS)}")
    refuse_unused_settings(names)
    plan = kernel_plan(names, model, shapes, max_side, quick)
    train_shapes = (
        training_shapes(model) if model is not None else list(dict.fromkeys(s for todo in plan.values() for s in todo))
    )
    train = (scaled_shapes(train_shapes, max_side) if quick else train_shapes, train_tokens)
    profile = _run_calibration(plan, torch_device.value, repeats, warmup, threads, comm_ranks, settings, train)
    from canzona.planner.partition.profile_cost import Profile, dump_profile

    validated = Profile.model_validate(profile)
    write_output(target, dump_profile(validated))
    echo(f"wrote {target}: {plural(len(validated.rows), 'row')} on {validated.device_name}")


def kernel_plan(
    names: list[str], model: str | None, shapes: Path | None, max_side: int, quick: bool
) -> dict[str, list[tuple[int, int]]]:
    """Optimizer -> the shapes to time: a shapes file's, a model's distinct ones, or the grid up
    to `max_side`; under --quick none longer than `max_side` on a side."""
    if shapes is not None:
        plan = {name: todo for name, todo in read_shapes(shapes).items() if name in names}
    else:
        todo = model_shapes(model) if model is not None else grid_shapes(max_side)
        plan = {name: todo for name in names}
    if not plan:
        raise PlanError("nothing to time: no shape is asked for with the chosen optimizers")
    if quick and any(max(shape) > max_side for todo in plan.values() for shape in todo):
        note(
            f"--quick: shapes scaled down to at most {max_side} on a side, aspect kept (the profile prices the full "
            "shapes by FLOP rate); leave --quick out to time them as they are"
        )
        plan = {name: scaled_shapes(todo, max_side) for name, todo in plan.items()}
    return plan


def calibrate_problem(
    repeats: int, warmup: int, threads: int | None, comm_ranks: int, max_side: int, settings: Settings
) -> str | None:
    """What is wrong with `calibrate`'s arguments, found before any timing (None: nothing)."""
    cpus = os.cpu_count() or 1
    return (
        bounded_int_problem("--repeats", repeats, MAX_REPEATS, "repeats")
        or bounded_int_problem("--warmup", warmup, MAX_REPEATS, "calls", minimum=0)
        or (
            bounded_int_problem("--threads", threads, cpus, f"threads (this machine has {cpus} CPUs)")
            if threads is not None
            else None
        )
        or (f"--comm-ranks must be 0 or >= 2, got {comm_ranks}" if comm_ranks == 1 or comm_ranks < 0 else None)
        or bounded_int_problem("--comm-ranks", comm_ranks, MAX_COMM_RANKS, "local processes", minimum=0)
        or bounded_int_problem("--max-side", max_side, MAX_GRID_SIDE, "rows or columns", minimum=128)
        or settings_problem("muon", *settings)
    )


def kernel_flops(plan: dict[str, list[tuple[int, int]]], settings: Settings, calls: int) -> dict[str, float]:
    """FLOPs each kernel the run times will execute (flops model; Shampoo and SOAP are timed on
    a refreshing step and on a plain one), keyed like its progress label."""
    from dataclasses import replace

    from canzona.planner.partition.costs import FlopsCost, OptimizerConfig
    from canzona.schedules.costs import methods_run
    from canzona.schedules.limits import MAX_PRECONDITION_FREQUENCY, STANDARD_NS

    work = {}
    for name, todo in plan.items():
        config = OptimizerConfig(name, *settings)
        steps = (
            [
                replace(config, precondition_frequency=1),
                replace(config, precondition_frequency=MAX_PRECONDITION_FREQUENCY),
            ]
            if name in TIMED_TWICE
            else [config]
        )
        for rows, cols in dict.fromkeys(todo):
            for method in methods_run(name, rows, cols):
                label = name if method == STANDARD_NS else f"{name} {method}"
                flops = sum(FlopsCost(replace(step, ns_method=method)).matrix_cost(rows, cols) for step in steps)
                work[f"{label} {rows}x{cols}"] = calls * flops
    return work


def _estimate(
    plan: dict[str, list[tuple[int, int]]],
    settings: Settings,
    calls: int,
    train: tuple[list[tuple[int, int]], int],
    flops_per_second: float,
    num_adamw: int,
    comm_ranks: int,
) -> str:
    """One line: what will be timed and about how long it takes at `flops_per_second`."""
    work = kernel_flops(plan, settings, calls)
    seconds = sum(work.values()) / flops_per_second
    if train[1] >= 1:
        seconds += calls * sum(6 * r * c * train[1] for r, c in train[0]) / flops_per_second
    counts = ", ".join(f"{name} {len(dict.fromkeys(todo))}" for name, todo in plan.items())
    extras = " and the training throughput" if train[1] >= 1 else ""
    extras += f" and a collective fit on {comm_ranks} processes" if comm_ranks >= 2 else ""
    return (
        f"timing {plural(len(work), 'matrix kernel')} ({counts}), {plural(num_adamw, 'AdamW size')}{extras}; "
        f"about {duration(seconds)} at this machine's Muon speed ({flops_per_second / 1e9:.3g} GFLOP/s), "
        "longer where eigendecompositions (Shampoo, SOAP) run slower than matrix products"
    )


MS_LABEL = re.compile(r"(\d+(?:\.\d+)?) ms$")


def _readable(line: str) -> str:
    """The runtime's `muon 1024x1024: 1234.567 ms` with the time in a readable unit."""
    return MS_LABEL.sub(lambda match: duration(float(match.group(1)) / 1e3), line)


def _run_calibration(
    plan: dict[str, list[tuple[int, int]]],
    device: str,
    repeats: int,
    warmup: int,
    threads: int | None,
    comm_ranks: int,
    settings: Settings,
    train: tuple[list[tuple[int, int]], int] = ([], 0),
) -> dict[str, Any]:
    try:
        from canzona.runtime.tools.calibrate import DEFAULT_ADAMW_SIZES, matrix_row
        from canzona.runtime.tools.calibrate import Settings as KernelSettings
        from canzona.runtime.tools.calibrate import calibrate as run
    except ImportError as error:  # torch is an optional dependency of the planner CLI
        raise PlanError(f"calibrate needs torch (pip install 'canzona[runtime]'): {error}") from error
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise PlanError("--torch-device cuda asked for, but torch sees no GPU")
    if threads is not None:
        torch.set_num_threads(threads)
    kernel = KernelSettings(*settings)
    from canzona.planner.partition.costs import FlopsCost, OptimizerConfig

    probe = matrix_row("muon", PROBE_SIDE, PROBE_SIDE, kernel, torch.device(device), 1, 1)["seconds"]
    rate = FlopsCost(OptimizerConfig("muon", *settings)).matrix_cost(PROBE_SIDE, PROBE_SIDE) / max(probe, 1e-9)
    note(_estimate(plan, settings, warmup + repeats, train, rate, len(DEFAULT_ADAMW_SIZES), comm_ranks))
    steps = len(kernel_flops(plan, settings, 1)) + len(DEFAULT_ADAMW_SIZES) + (1 if train[1] >= 1 else 0)
    try:
        with progress(f"calibrating on {device}", steps, lines=True) as step:
            return run(
                [],
                kernel,
                device,
                repeats,
                warmup,
                plan,
                threads=threads,
                comm_ranks=comm_ranks,
                progress=lambda line: step(_readable(line)),
                train_shapes=train[0],
                train_tokens=train[1],
            )
    except ValueError as error:
        raise PlanError(str(error)) from error
