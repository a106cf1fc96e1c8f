"""The `canzona` command: results on stdout, diagnostics on stderr, one-line errors.

Exit codes: 0 success, 1 internal error, 2 bad input (usage, model, layout, files), 130 / 143
interrupted (SIGINT / SIGTERM; temporary files are removed first).
Set CANZONA_DEBUG=1 to get tracebacks instead of one-line errors.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import time
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

# Only what the commands' signatures name is loaded here, so `canzona --version` and `-h` start
# in a fraction of a second; each command loads the planner, pydantic and YAML itself.
from canzona.cli import calibrate_cmd, compare, describe_cmd, render, report, reshard_cmd, simulate_cmd
from canzona.cli.options import (
    Dtype,
    DEVICE_HELP,
    SCHEDULE_HELP,
    device_file,
    device_option,
    load_schedule,
    output_path,
    refuse_unless,
    refuse_unused_settings,
    write_output,
)
from canzona.cli.progress import progress, warn
from canzona.cli.wording import echo, plural
from canzona.planner.partition.tp import DEFAULT_GROUP_MB
from canzona.planner.spec import DEFAULT_GLOBAL_BATCH, DEFAULT_SEQ_LEN, MATRIX, PlanError
from canzona.schedules.errors import ScheduleError
from canzona.schedules.files import OutputError, check_output
from canzona.schedules.geometry import DEFAULT_BUCKET_SIZE
from canzona.schedules.limits import FSDP, MAX_GROUP_BYTES, PROFILE_PREFIX, REPLICATED

if TYPE_CHECKING:
    from canzona.planner.spec import ModelSpec
    from canzona.schedules.format import Schedule

try:  # typer >= 0.20 vendors click
    from typer._click.exceptions import ClickException
except ImportError:  # pragma: no cover - older typer depends on click
    from click.exceptions import ClickException

EXIT_INTERNAL = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
EXIT_TERMINATED = 143  # 128 + SIGTERM
KNOWN_ERRORS = (PlanError, ScheduleError, OutputError)

MIB = 1 << 20

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    # Plain help text: rich markup would eat "[rows, cols]" and print flags as "<bool>".
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Plan and inspect canzona schedules for matrix optimizers under DP x TP. "
    "Concepts and file format: docs/README.md.",
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        echo(f"canzona {version('canzona')}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                          help="Print canzona's version and exit.")] = False,
) -> None:
    """Plan and inspect canzona schedules for matrix optimizers under DP x TP."""


class Optimizer(str, Enum):
    muon = "muon"
    shampoo = "shampoo"
    soap = "soap"


class QkvSplit(str, Enum):
    none = "none"
    qkv = "qkv"
    head = "head"


class TpMode(str, Enum):
    rollback = "rollback"
    fixed = "fixed"
    sorted = "sorted"
    heap = "heap"


class Coop(str, Enum):
    off = "off"
    auto = "auto"
    force = "force"


class Solver(str, Enum):
    greedy = "greedy"
    ilp = "ilp"


class Order(str, Enum):
    registration = "registration"
    free = "free"


class RouterOptimizer(str, Enum):
    matrix = "matrix"
    adamw = "adamw"


class Names(str, Enum):
    auto = "auto"
    megatron = "megatron"
    hf = "hf"
    torchtitan = "torchtitan"


def _bucket_size(text: str) -> int | None:
    """A bucket size in elements, or None for auto."""
    if text.strip().lower() == "auto":
        return None
    try:
        return int(text)
    except ValueError:
        raise PlanError(f"bucket size must be a whole number of elements or auto, got {text!r}") from None


def _alpha(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise PlanError(f"alpha must be a number in [0, 1] or auto, got {text!r}") from None


def default_output(
    model_name: str, optimizer: str, tp: int, dp: int, alpha: float | str, cost: str, ep: int = 1, fsdp_replicate: int = 0
) -> Path:
    """schedules/<model>/<optimizer>-tp<T>-dp<D>[-ep<E>][-fsdp|-hsdp<R>][-alpha<A>][-<cost>].yaml
    (`fsdp_replicate`: 0 without FSDP, else the HSDP replicas, 1 for plain FSDP)."""
    stem = f"{optimizer}-tp{tp}-dp{dp}" + (f"-ep{ep}" if ep > 1 else "")
    if fsdp_replicate:
        stem += "-fsdp" if fsdp_replicate == 1 else f"-hsdp{fsdp_replicate}"
    if alpha != 1.0:
        stem += f"-alpha{alpha}" if isinstance(alpha, str) else f"-alpha{alpha:g}"
    if cost.startswith("profile:"):
        stem += "-profile-" + Path(cost.removeprefix("profile:")).stem
    elif cost != "flops":
        stem += f"-{cost}"
    return Path("schedules") / model_name / f"{stem}.yaml"


@app.command()
def models(as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False) -> None:
    """List the built-in model presets with their parameter counts."""
    from canzona.planner.sources.load import count_params, list_presets

    rows = [report.preset_row(name, arch, count_params(arch)) for name, arch in list_presets()]
    echo(json.dumps(rows, indent=2) if as_json else report.presets_table(rows))


@app.command()
def plan(
    model: Annotated[str, typer.Option(help="Preset name, HF config.json, parameter-list YAML/JSON, or a live model py:MODULE:FACTORY.")],
    tp: Annotated[int, typer.Option(help="Tensor-parallel size.")] = 1,
    dp: Annotated[int, typer.Option(help="Data-parallel size.")] = 1,
    optimizer: Annotated[Optimizer, typer.Option(help="Matrix optimizer.")] = Optimizer.muon,
    cost: Annotated[str, typer.Option(help="Cost model balanced across ranks: numel, flops, or profile:FILE.")] = "flops",
    alpha: Annotated[str, typer.Option(help="In [0, 1] (1 balances compute, 0 keeps slices equal), or auto.")] = "1",
    device: Annotated[str, typer.Option(help=DEVICE_HELP + " Only with --alpha auto or --bucket-size auto.")] = "h100",
    bucket_size: Annotated[str, typer.Option(help="Bucket size in elements, or auto (the simulator's fastest iteration).")] = str(DEFAULT_BUCKET_SIZE),
    global_batch: Annotated[int, typer.Option(help="auto searches: sequences per optimizer step, over all DP ranks.")] = DEFAULT_GLOBAL_BATCH,
    seq_len: Annotated[int, typer.Option(help="auto searches: tokens per sequence.")] = DEFAULT_SEQ_LEN,
    micro_batches: Annotated[Optional[int], typer.Option(help="auto searches: micro-batches per DP rank (default: global batch / dp).")] = None,
    split_qkv: Annotated[QkvSplit, typer.Option(help="How QKV is orthogonalised.")] = QkvSplit.qkv,
    split_fc1: Annotated[bool, typer.Option("--split-fc1/--no-split-fc1", help="Update fc1 gate and up halves separately.")] = False,
    router_optimizer: Annotated[RouterOptimizer, typer.Option(help="Optimizer of MoE routers.")] = RouterOptimizer.matrix,
    names: Annotated[Names, typer.Option(help="Parameter names of a preset or HF config: megatron, hf (transformers), torchtitan; auto: hf for a config.json, megatron for a preset.")] = Names.auto,
    sequence_parallel: Annotated[bool, typer.Option("--sequence-parallel", help="Every norm's gradient is a partial sum over TP, which the optimizer sums (leave off if the model reduces them itself).")] = False,
    dtype: Annotated[Optional[Dtype], typer.Option(help="Dtype of every parameter, over the source's own (a config.json's dtype / torch_dtype, bf16 for a preset or a config without one, each entry's for a parameter list or live model).", show_default=False)] = None,
    ns_steps: Annotated[int, typer.Option(help="Muon Newton-Schulz steps.")] = 5,
    block_size: Annotated[int, typer.Option(help="Shampoo block size.")] = 1024,
    precondition_frequency: Annotated[int, typer.Option(help="Shampoo/SOAP preconditioner refresh every N steps.")] = 10,
    max_precond_dim: Annotated[int, typer.Option(help="SOAP: sides above this get no preconditioner.")] = 10000,
    mode: Annotated[TpMode, typer.Option(help="TP micro-group scheduler.")] = TpMode.rollback,
    group_mb: Annotated[float, typer.Option(help="MiB of gathered fp32 gradients a host holds per micro-group.")] = DEFAULT_GROUP_MB,
    coop: Annotated[Coop, typer.Option(help="Cooperative hosting (Muon): auto hosts a dominant matrix on several TP ranks where that shortens the busiest device; force: every eligible matrix on all TP ranks (tests); off.")] = Coop.auto,
    ep: Annotated[int, typer.Option(help="Expert-parallel size (MoE models).")] = 1,
    fsdp: Annotated[bool, typer.Option("--fsdp", help="Parameters are sharded by FSDP2 (fully_shard) over DP: plan hosts over DP shard x TP.")] = False,
    dp_replicate: Annotated[int, typer.Option(help="--fsdp: HSDP replicas (dp = replicate x shard).")] = 1,
    solver: Annotated[Solver, typer.Option(help="greedy, or ilp: refine with CP-SAT (needs ortools).")] = Solver.greedy,
    time_limit: Annotated[float, typer.Option(help="--solver ilp: CP-SAT budget in deterministic seconds.")] = 10.0,
    seed: Annotated[int, typer.Option(help="--solver ilp: CP-SAT random seed.")] = 0,
    order: Annotated[Optional[Order], typer.Option(help="Parameter order inside a bucket: free (the planner's; canzona's runtime owns its exchange buffer) or registration (Megatron's fixed gradient buffer). Default: free, or registration with --solver ilp.", show_default=False)] = None,
    output: Annotated[Optional[str], typer.Option("--output", "-o", metavar="FILE", help="Schedule file to write (default: schedules/<model>/<name>.yaml).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Solve the DP partition for a model and layout, and write the schedule file."""
    from dataclasses import replace

    from canzona.cli.sources import load_source, source_files
    from canzona.planner.compile import compile_schedule
    from canzona.planner.partition.costs import OptimizerConfig
    from canzona.planner.plan import PlanRequest, TrainingSetup
    from canzona.planner.predict.auto_alpha import plan_for_request, search_steps
    from canzona.planner.spec import ModelOptions
    from canzona.schedules.format import dump_schedule

    started = time.perf_counter()
    _check_group_mb(group_mb)
    auto = alpha.strip().lower() == "auto"
    size = _bucket_size(bucket_size)
    searching = auto or size is None
    refuse_unless(searching, ("device", "global_batch", "seq_len", "micro_batches"),
                  "it sets up the simulation that --alpha auto and --bucket-size auto search with")
    refuse_unless(solver == Solver.ilp, ("time_limit", "seed"), "it applies to --solver ilp")
    refuse_unless(fsdp, ("dp_replicate",), "it sets the HSDP replicas of --fsdp")
    refuse_unless(not fsdp, ("order",), "FSDP plans have no buckets to order")
    refuse_unless(optimizer == Optimizer.muon and tp > 1 and not fsdp, ("coop",),
                  "cooperative hosting applies to Muon with tp > 1, without --fsdp")
    refuse_unused_settings([optimizer.value])
    searched_on = device_option(device) if searching else None
    options = ModelOptions(split_qkv.value, split_fc1, router_optimizer.value, names.value, sequence_parallel,
                           None if dtype is None else dtype.value)
    settings = OptimizerConfig(optimizer.value, ns_steps, block_size, precondition_frequency, max_precond_dim)
    request = PlanRequest(
        model, tp, dp, settings, cost, 1.0 if auto else _alpha(alpha), DEFAULT_BUCKET_SIZE if size is None else size, options,
        mode.value, int(group_mb * MIB), ep, solver.value, time_limit, seed, searched_on if auto else None,
        searched_on if size is None else None, TrainingSetup(global_batch, seq_len, micro_batches) if searching else None,
        FSDP if fsdp else REPLICATED, dp_replicate,
        coop.value,
        None if order is None else order.value,
    )
    request.validate()
    inputs = [*source_files(model), cost.removeprefix(PROFILE_PREFIX) if cost.startswith(PROFILE_PREFIX) else None,
              device_file(searched_on or "")]
    target = None if output is None else output_path(output)
    if target is not None:
        check_output(target, inputs, "--output")
    spec = load_source(model, tp, options)
    request = replace(request, options=replace(options, names=spec.names))  # auto resolved by the source
    path = target or default_output(spec.name, optimizer.value, tp, dp, "auto" if auto else request.alpha, cost, ep,
                                    (dp_replicate if fsdp else 0))
    check_output(path, inputs, "output")
    warned = fsdp or _warn_few_matrices(spec, dp, ep)
    steps = search_steps(request)
    with progress(f"planning {spec.name} tp {tp} x dp {dp}", steps or None) as step:
        the_plan, search = plan_for_request(spec, request, progress=step if steps else None)
        schedule = compile_schedule(the_plan, search)
    write_output(path, dump_schedule(schedule))
    summary = report.plan_summary(schedule, str(path), time.perf_counter() - started)
    echo(json.dumps(summary, indent=2) if as_json else report.summary_text(summary))
    if not warned:
        _warn_idle_ranks(schedule)


def _check_group_mb(group_mb: float) -> None:
    """--group-mb is a finite number of MiB, at least one byte; errors speak MiB, as the option."""
    problem = None
    if not math.isfinite(group_mb):
        problem = f"--group-mb must be a finite number of MiB, got {group_mb}"
    elif group_mb <= 0:
        problem = f"--group-mb must be > 0 MiB, got {group_mb:g} MiB"
    elif group_mb > MAX_GROUP_BYTES / MIB:
        problem = f"--group-mb must be <= {MAX_GROUP_BYTES / MIB:g} MiB, got {group_mb:g} MiB"
    elif int(group_mb * MIB) < 1:
        problem = f"--group-mb must be at least one byte ({1 / MIB:.3g} MiB), got {group_mb:g} MiB"
    if problem:
        raise PlanError(problem)


IDLE_SHARE = 0.5  # warn when more than this share of DP ranks has no matrix to update


def _warn_few_matrices(spec: ModelSpec, dp: int, ep: int) -> bool:
    """Warn before planning when the model has too few matrices for most DP ranks to get one
    (matrices are never split between DP ranks). True if it warned."""
    matrices = sum(1 for p in spec.params if p.optimizer == MATRIX)
    if ep != 1 or matrices >= dp * (1 - IDLE_SHARE):
        return False
    warn(f"{spec.name} has {plural(matrices, 'matrix', 'matrices')} for {dp} DP ranks: at least "
         f"{dp - matrices} ranks will have nothing to update and the busiest rank sets the step; "
         "a smaller --dp (or a larger --tp) balances better")
    return True


def _warn_idle_ranks(schedule: Schedule) -> None:
    """Warn after planning when most DP ranks own no matrix."""
    loads = schedule.metrics.dp.load
    idle = sum(1 for load in loads if load == 0)
    if idle > IDLE_SHARE * len(loads):
        warn(f"{idle} of {len(loads)} DP ranks own no matrix to update (DP imbalance "
             f"{schedule.metrics.dp.imbalance:.1f}); a smaller --dp (or a larger --tp) balances better")


@app.command()
def show(
    file: Annotated[str, typer.Argument(metavar="SCHEDULE", help=SCHEDULE_HELP)],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
    rank: Annotated[Optional[int], typer.Option(help="Show one device (global rank = dp_rank * tp + tp_rank).")] = None,
) -> None:
    """Show a schedule: per-rank loads as bars, imbalance, gap, memory, baselines, TP modes."""
    schedule = load_schedule(file)
    if rank is not None:
        world = schedule.request.tp * schedule.request.dp
        if not 0 <= rank < world:
            raise ScheduleError(f"rank {rank} is outside the world of {world} devices")
        part = report.rank_part(schedule, rank)
        echo(json.dumps(part, indent=2) if as_json else report.rank_text(part))
    elif as_json:
        data = {"request": schedule.request.model_dump(mode="json"), "metrics": report.metrics_data(schedule),
                "collectives": report.bucket_collectives(schedule)}
        echo(json.dumps(data, indent=2))
    else:
        echo(report.show_text(schedule))


app.command()(describe_cmd.describe)
app.command()(compare.diff)
app.command()(compare.check)
app.command()(compare.table)
app.command()(render.render)
app.command()(simulate_cmd.simulate)
app.command()(calibrate_cmd.calibrate)
app.command("reshard-check")(reshard_cmd.reshard_check)


class Terminated(Exception):
    """SIGTERM, raised like KeyboardInterrupt so every `finally` (temporary files) runs."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    """Run the CLI on `argv` (default: the process's arguments); return the exit code instead
    of exiting. No arguments at all print the help."""
    debug = os.environ.get("CANZONA_DEBUG") == "1"
    args = sys.argv[1:] if argv is None else list(argv)
    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None
    try:
        result = app(args=args or ["--help"], prog_name="canzona", standalone_mode=False)
    except ClickException as error:
        echo(f"canzona: error: {error.format_message()}", err=True)
        return EXIT_BAD_INPUT
    except (KeyboardInterrupt, typer.Abort):  # typer itself turns Ctrl-C into exit code 130
        echo("canzona: interrupted", err=True)
        return EXIT_INTERRUPTED
    except Terminated:
        echo("canzona: terminated", err=True)
        return EXIT_TERMINATED
    except KNOWN_ERRORS as error:
        if debug:
            raise
        echo(f"canzona: error: {error}", err=True)
        return EXIT_BAD_INPUT
    except OSError as error:  # a file the command had to read or write
        if debug:
            raise
        where = f"{error.filename}: " if error.filename else ""
        echo(f"canzona: error: {where}{error.strerror or error}", err=True)
        return EXIT_BAD_INPUT
    except Exception as error:  # noqa: BLE001 - the last line of defence against tracebacks
        if debug:
            raise
        echo(f"canzona: internal error: {type(error).__name__}: {error} (CANZONA_DEBUG=1 for details)", err=True)
        return EXIT_INTERNAL
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return result if isinstance(result, int) else 0


def run() -> None:
    """Console-script entry point."""
    sys.exit(main())
