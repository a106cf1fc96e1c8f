"""`canzona plan` (registered in `canzona.cli.main`): the options become one `PlanRequest`, built
by keyword; the model source is read, the output path chosen and checked (`cli/plan_output.py`)
before any planning; then the plan is solved, compiled and written, and summarised on stdout."""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace
from enum import Enum, EnumMeta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from canzona.cli import report
from canzona.cli.options import (
    DEVICE_HELP,
    Dtype,
    device_file,
    device_option,
    output_path,
    refuse_unless,
    refuse_unused_settings,
    write_output,
)
from canzona.cli.plan_output import DEFAULT_DEVICE, MIB, default_output, in_checkout, replacement_problem
from canzona.cli.progress import progress, warn
from canzona.cli.wording import echo, plural
from canzona.planner.spec import ADAMW, DEFAULT_GLOBAL_BATCH, DEFAULT_SEQ_LEN, MATRIX, PlanError
from canzona.schedules.files import OutputError, check_output
from canzona.schedules.geometry import DEFAULT_BUCKET_SIZE
from canzona.schedules.limits import (
    COOP_MODES,
    DEFAULT_GRAM_RESTART,
    DEFAULT_GROUP_MB,
    FSDP,
    MATRIX_OPTIMIZERS,
    MAX_GROUP_BYTES,
    NAMING_CONVENTIONS,
    NS_COEFFICIENT_NAMES,
    NS_DTYPES,
    NS_METHODS,
    ORDERS,
    PROFILE_PREFIX,
    QKV_SPLITS,
    REPLICATED,
    SOLVERS,
    TP_MODES,
    TP_UPDATE_REQUESTS,
)

if TYPE_CHECKING:
    from canzona.planner.request import PlanRequest
    from canzona.planner.spec import ModelSpec
    from canzona.schedules.format import Schedule

IDLE_SHARE = 0.5  # warn when more than this share of DP ranks has no matrix to update
OUTPUT_HELP = (
    "Schedule file to write (default: schedules/<model>/<name>.yaml in a canzona checkout, else "
    "./<model>-<name>.yaml; <name> spells out every option that changes the plan)."
)


def choices(name: str, values: tuple[str, ...]) -> Any:
    """A typer choice over a vocabulary: an Enum whose members are `values`, each named and valued
    as itself (the vocabularies live in `canzona.schedules.limits`, which the planner checks by)."""
    return Enum(name, [(value, value) for value in values], type=str)


if TYPE_CHECKING:
    # mypy cannot follow Enums built at run time: it sees each vocabulary as `Choice`, an Enum
    # of str whose members it takes on trust.
    class _AnyMembers(EnumMeta):
        def __getattr__(cls, name: str) -> Any: ...

    class Choice(str, Enum, metaclass=_AnyMembers):
        """A vocabulary's Enum, as `choices` builds it."""

    Optimizer = Choice
    QkvSplit = Choice
    NsCoefficients = Choice
    NsMethod = Choice
    NsDtype = Choice
    TpMode = Choice
    Coop = Choice
    TpUpdate = Choice
    Solver = Choice
    Order = Choice
    RouterOptimizer = Choice
    Names = Choice
else:
    Optimizer = choices("Optimizer", MATRIX_OPTIMIZERS)
    QkvSplit = choices("QkvSplit", QKV_SPLITS)
    NsCoefficients = choices("NsCoefficients", NS_COEFFICIENT_NAMES)
    NsMethod = choices("NsMethod", NS_METHODS)
    NsDtype = choices("NsDtype", NS_DTYPES)
    TpMode = choices("TpMode", TP_MODES)
    Coop = choices("Coop", COOP_MODES)
    TpUpdate = choices("TpUpdate", TP_UPDATE_REQUESTS)
    Solver = choices("Solver", SOLVERS)
    Order = choices("Order", ORDERS)
    RouterOptimizer = choices("RouterOptimizer", (MATRIX, ADAMW))
    Names = choices("Names", ("auto", *NAMING_CONVENTIONS))


def plan(
    model: Annotated[
        str,
        typer.Option(help="Preset name, HF config.json, parameter-list YAML/JSON, or a live model py:MODULE:FACTORY."),
    ],
    tp: Annotated[int, typer.Option(help="Tensor-parallel size.")] = 1,
    dp: Annotated[int, typer.Option(help="Data-parallel size.")] = 1,
    optimizer: Annotated[Optimizer, typer.Option(help="Matrix optimizer.")] = Optimizer.muon,
    cost: Annotated[
        str, typer.Option(help="Cost model balanced across ranks: numel, flops, or profile:FILE.")
    ] = "flops",
    alpha: Annotated[str, typer.Option(help="In [0, 1] (1 balances compute, 0 keeps slices equal), or auto.")] = "1",
    device: Annotated[
        str, typer.Option(help=DEVICE_HELP + " Only with --alpha auto or --bucket-size auto.")
    ] = DEFAULT_DEVICE,
    bucket_size: Annotated[
        str, typer.Option(help="Bucket size in elements, or auto (the simulator's fastest iteration).")
    ] = str(DEFAULT_BUCKET_SIZE),
    global_batch: Annotated[
        int, typer.Option(help="auto searches: sequences per optimizer step, over all DP ranks.")
    ] = DEFAULT_GLOBAL_BATCH,
    seq_len: Annotated[int, typer.Option(help="auto searches: tokens per sequence.")] = DEFAULT_SEQ_LEN,
    micro_batches: Annotated[
        int | None, typer.Option(help="auto searches: micro-batches per DP rank (default: global batch / dp).")
    ] = None,
    split_qkv: Annotated[QkvSplit, typer.Option(help="How QKV is orthogonalised.")] = QkvSplit.qkv,
    split_fc1: Annotated[
        bool, typer.Option("--split-fc1/--no-split-fc1", help="Update fc1 gate and up halves separately.")
    ] = False,
    router_optimizer: Annotated[
        RouterOptimizer, typer.Option(help="Optimizer of MoE routers.")
    ] = RouterOptimizer.matrix,
    names: Annotated[
        Names,
        typer.Option(
            help=(
                "Parameter names of a preset or HF config: megatron, hf (transformers), torchtitan; auto: hf for a "
                "config.json, megatron for a preset."
            )
        ),
    ] = Names.auto,
    sequence_parallel: Annotated[
        bool,
        typer.Option(
            "--sequence-parallel",
            help=(
                "Every norm's gradient is a partial sum over TP, which the optimizer sums (leave off if the model "
                "reduces them itself)."
            ),
        ),
    ] = False,
    dtype: Annotated[
        Dtype | None,
        typer.Option(
            help=(
                "Dtype of every parameter, over the source's own (a config.json's dtype / torch_dtype, bf16 for a "
                "preset or a config without one, each entry's for a parameter list or live model)."
            ),
            show_default=False,
        ),
    ] = None,
    ns_steps: Annotated[int, typer.Option(help="Muon Newton-Schulz steps.")] = 5,
    ns_coefficients: Annotated[
        NsCoefficients,
        typer.Option(
            help=(
                "Muon's Newton-Schulz coefficients per iteration: simple (one triple), quintic (Megatron-core's "
                "default), polar_express."
            )
        ),
    ] = NsCoefficients.simple,
    ns_method: Annotated[
        NsMethod,
        typer.Option(
            help=(
                "Muon's Newton-Schulz: standard, or gram (iterates on the Gram matrix; a matrix at most twice as "
                "long as wide falls back to standard)."
            )
        ),
    ] = NsMethod.standard,
    gram_restart: Annotated[
        int, typer.Option(help="--ns-method gram: restart after this many iterations (0: never).")
    ] = DEFAULT_GRAM_RESTART,
    ns_dtype: Annotated[
        NsDtype,
        typer.Option(help="Muon's Newton-Schulz precision (auto: bf16 on CUDA); the simulator prices it."),
    ] = NsDtype.auto,
    block_size: Annotated[int, typer.Option(help="Shampoo block size.")] = 1024,
    precondition_frequency: Annotated[
        int, typer.Option(help="Shampoo/SOAP preconditioner refresh every N steps.")
    ] = 10,
    max_precond_dim: Annotated[int, typer.Option(help="SOAP: sides above this get no preconditioner.")] = 10000,
    mode: Annotated[TpMode, typer.Option(help="TP micro-group scheduler.")] = TpMode.rollback,
    group_mb: Annotated[
        float, typer.Option(help="MiB of gathered fp32 gradients a host holds per micro-group.")
    ] = DEFAULT_GROUP_MB,
    coop: Annotated[
        Coop,
        typer.Option(
            help=(
                "Cooperative hosting (Muon): auto hosts a dominant matrix on several TP ranks where that shortens "
                "the busiest device; force: every eligible matrix on all TP ranks (tests); off."
            )
        ),
    ] = Coop.auto,
    tp_update: Annotated[
        TpUpdate,
        typer.Option(
            help=(
                "How TP updates a DP rank's matrices: hosted (each on one TP rank of a micro-group, the update "
                "scattered back), replicated (all-gathered, every TP rank updates every matrix: no scatter, P "
                "times the matrix state), or auto: the one predicted faster."
            )
        ),
    ] = TpUpdate.auto,
    ep: Annotated[int, typer.Option(help="Expert-parallel size (MoE models).")] = 1,
    fsdp: Annotated[
        bool,
        typer.Option(
            "--fsdp", help="Parameters are sharded by FSDP2 (fully_shard) over DP: plan hosts over DP shard x TP."
        ),
    ] = False,
    dp_replicate: Annotated[int, typer.Option(help="--fsdp: HSDP replicas (dp = replicate x shard).")] = 1,
    solver: Annotated[Solver, typer.Option(help="greedy, or ilp: refine with CP-SAT (needs ortools).")] = Solver.greedy,
    time_limit: Annotated[float, typer.Option(help="--solver ilp: CP-SAT budget in deterministic seconds.")] = 10.0,
    seed: Annotated[int, typer.Option(help="--solver ilp: CP-SAT random seed.")] = 0,
    order: Annotated[
        Order | None,
        typer.Option(
            help=(
                "Parameter order inside a bucket: free (the planner's; canzona's runtime owns its exchange buffer) "
                "or registration (Megatron's fixed gradient buffer). Default: free, or registration with "
                "--solver ilp."
            ),
            show_default=False,
        ),
    ] = None,
    output: Annotated[str | None, typer.Option("--output", "-o", metavar="FILE", help=OUTPUT_HELP)] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing file that holds another plan (or no schedule).")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
) -> None:
    """Solve the DP partition for a model and layout, and write the schedule file."""
    from canzona.planner.partition.costs import OptimizerConfig
    from canzona.planner.request import PlanRequest, TrainingSetup
    from canzona.planner.spec import ModelOptions

    started = time.perf_counter()
    _check_group_mb(group_mb)
    searched_alpha, size = alpha.strip().lower() == "auto", _bucket_size(bucket_size)
    searched_on = _refuse_options_without_effect(
        searched_alpha or size is None, device, solver.value, fsdp, optimizer.value, tp, ns_method.value
    )
    request = PlanRequest(
        model,
        tp,
        dp,
        optimizer=OptimizerConfig(
            optimizer.value,
            ns_steps=ns_steps,
            block_size=block_size,
            precondition_frequency=precondition_frequency,
            max_precond_dim=max_precond_dim,
            ns_coefficients=ns_coefficients.value,
            ns_method=ns_method.value,
            gram_restart=gram_restart,
            ns_dtype=ns_dtype.value,
        ),
        cost=cost,
        alpha=1.0 if searched_alpha else _alpha(alpha),
        bucket_size=DEFAULT_BUCKET_SIZE if size is None else size,
        options=ModelOptions(
            split_qkv=split_qkv.value,
            split_fc1=split_fc1,
            router_optimizer=router_optimizer.value,
            names=names.value,
            sequence_parallel=sequence_parallel,
            dtype=None if dtype is None else dtype.value,
        ),
        tp_mode=mode.value,
        group_bytes=int(group_mb * MIB),
        ep=ep,
        solver=solver.value,
        time_limit=time_limit,
        seed=seed,
        alpha_device=searched_on if searched_alpha else None,
        bucket_device=searched_on if size is None else None,
        training=(
            TrainingSetup(global_batch=global_batch, seq_len=seq_len, micro_batches=micro_batches)
            if searched_on is not None
            else None
        ),
        sharding=FSDP if fsdp else REPLICATED,
        dp_replicate=dp_replicate,
        coop=coop.value,
        tp_update=tp_update.value,
        order=None if order is None else order.value,
    )
    request.validate()
    write_plan(request, output, force, as_json, started)


def _refuse_options_without_effect(
    searching: bool, device: str, solver: str, fsdp: bool, optimizer: str, tp: int, ns_method: str
) -> str | None:
    """Refuse every option the other options make pointless; the device the automatic searches
    simulate on (None: no search)."""
    refuse_unless(
        searching,
        ("device", "global_batch", "seq_len", "micro_batches"),
        "it sets up the simulation that --alpha auto and --bucket-size auto search with",
    )
    refuse_unless(solver == "ilp", ("time_limit", "seed"), "it applies to --solver ilp")
    refuse_unless(fsdp, ("dp_replicate",), "it sets the HSDP replicas of --fsdp")
    refuse_unless(not fsdp, ("order",), "FSDP plans have no buckets to order")
    refuse_unless(
        optimizer == "muon" and tp > 1 and not fsdp,
        ("coop",),
        "cooperative hosting applies to Muon with tp > 1, without --fsdp",
    )
    refuse_unless(optimizer == "muon" and ns_method == "gram", ("gram_restart",), "it applies to --ns-method gram")
    refuse_unless(tp > 1 and not fsdp, ("tp_update",), "the TP update applies with tp > 1, without --fsdp")
    refuse_unused_settings([optimizer])
    return device_option(device) if searching else None


def write_plan(request: PlanRequest, output: str | None, force: bool, as_json: bool, started: float) -> None:
    """Read the model, choose and check the output before planning, then plan, write the
    schedule and print its summary."""
    from canzona.cli.sources import load_source
    from canzona.schedules.format import dump_schedule

    inputs = _inputs(request)
    target = None if output is None else output_path(output)
    if target is not None:
        check_output(target, inputs, "--output")
    explicit = request.options.names != "auto"
    if explicit:
        _refuse_names_of_a_listed_model(request.model, request.options.names)
    spec = load_source(request.model, request.tp, request.options)
    _note_default_dtype(request)
    request = replace(request, options=replace(request.options, names=spec.names))  # auto resolved by the source
    path = target or default_output(spec.name, request, _own_names(request) if explicit else spec.names, in_checkout())
    check_output(path, inputs, "output")
    problem = None if force else replacement_problem(path, request.to_request(spec))
    if problem:
        raise OutputError(problem)
    schedule = _solve(spec, request)
    payload = dump_schedule(schedule).encode()
    written = not _holds(path, payload)
    if written:  # the same bytes already there: nothing to write (nor to say it was written)
        write_output(path, payload)
    summary = report.plan_summary(schedule, str(path), time.perf_counter() - started, written)
    echo(json.dumps(summary, indent=2) if as_json else report.summary_text(summary))


def _holds(path: Path, payload: bytes) -> bool:
    """Whether the regular file at `path` already holds exactly `payload`."""
    try:
        return path.is_file() and path.stat().st_size == len(payload) and path.read_bytes() == payload
    except OSError:
        return False


def _inputs(request: PlanRequest) -> list[str | None]:
    """The files planning reads, which the output must not replace."""
    from canzona.cli.sources import source_files

    profile = request.cost.removeprefix(PROFILE_PREFIX) if request.cost.startswith(PROFILE_PREFIX) else None
    return [*source_files(request.model), profile, device_file(request.alpha_device or request.bucket_device or "")]


def _note_default_dtype(request: PlanRequest) -> None:
    """Say so when a config declares no dtype and none was given: the plan is the default's."""
    from canzona.cli.sources import is_live
    from canzona.planner.sources.load import DEFAULT_DTYPE, undeclared_dtype

    if request.options.dtype is None and not is_live(request.model) and undeclared_dtype(request.model):
        warn(
            f"{request.model} declares no dtype: planned in {DEFAULT_DTYPE}, the default; transformers builds such a "
            "model in fp32 (plan it with --dtype fp32 to train it so)"
        )


def _refuse_names_of_a_listed_model(source: str, names: str) -> None:
    """`--names` (given) chooses the names of a preset or a Hugging Face config; a parameter
    list and a live model keep their own, so the option would be recorded and not applied."""
    from canzona.cli.sources import is_live
    from canzona.planner.sources.load import names_apply

    if not names_apply(source):
        kind = "a live model" if is_live(source) else "a parameter list"
        raise PlanError(
            f"--names {names} applies to presets and Hugging Face configs; {kind} names its parameters itself"
        )


def _own_names(request: PlanRequest) -> str:
    """The naming convention `--names auto` would give this model source (what a default file
    name leaves unsaid)."""
    from canzona.cli.sources import is_live
    from canzona.planner.sources.load import own_names

    return "megatron" if is_live(request.model) else own_names(request.model)


def _solve(spec: ModelSpec, request: PlanRequest) -> Schedule:
    """The schedule of `request` (its automatic searches included, with a progress bar), after
    warning where most DP ranks will have nothing to update."""
    from canzona.planner.compile import compile_schedule
    from canzona.planner.predict.auto_alpha import plan_for_request, search_steps

    warned = request.sharding == FSDP or _warn_few_matrices(spec, request.dp, request.ep)
    steps = search_steps(request)
    with progress(f"planning {spec.name} tp {request.tp} x dp {request.dp}", steps or None) as step:
        the_plan, search = plan_for_request(spec, request, progress=step if steps else None)
        schedule = compile_schedule(the_plan, search)
    if not warned:
        _warn_idle_ranks(schedule)
    return schedule


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


def _warn_few_matrices(spec: ModelSpec, dp: int, ep: int) -> bool:
    """Warn before planning when the model has too few matrices for most DP ranks to get one
    (matrices are never split between DP ranks). True if it warned."""
    matrices = sum(1 for p in spec.params if p.optimizer == MATRIX)
    if ep != 1 or matrices >= dp * (1 - IDLE_SHARE):
        return False
    warn(
        f"{spec.name} has {plural(matrices, 'matrix', 'matrices')} for {dp} DP ranks: at least "
        f"{dp - matrices} ranks will have nothing to update and the busiest rank sets the step; "
        "a smaller --dp (or a larger --tp) balances better"
    )
    return True


def _warn_idle_ranks(schedule: Schedule) -> None:
    """Warn after planning when most DP ranks own no matrix."""
    loads = schedule.metrics.dp.load
    idle = sum(1 for load in loads if load == 0)
    if idle > IDLE_SHARE * len(loads):
        warn(
            f"{idle} of {len(loads)} DP ranks own no matrix to update (DP imbalance "
            f"{schedule.metrics.dp.imbalance:.1f}); a smaller --dp (or a larger --tp) balances better"
        )
