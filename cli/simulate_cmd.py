"""`canzona simulate` (registered in `canzona.cli.main`): predict one optimizer step and one
training iteration of a schedule and of every baseline on a hardware model.

Times are printed in one unit per table, the one its largest value reads best in (ms, s, min
or h), so a CPU prediction of hours is not a column of millions of milliseconds.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from typing import TYPE_CHECKING, Annotated, Any

import typer

from canzona.cli.options import DEVICE_HELP, SCHEDULE_HELP, device_option, load_schedule, refuse_unless
from canzona.cli.report import index_ranges
from canzona.cli.wording import echo, table_unit
from canzona.planner.spec import DEFAULT_GLOBAL_BATCH, DEFAULT_SEQ_LEN
from canzona.schedules.limits import AS_SCHEDULED, DP_COLLECTIVE_MODES

if TYPE_CHECKING:  # loaded by the command itself: `canzona -h` stays fast
    from canzona.planner.partition.costs import OptimizerConfig
    from canzona.planner.predict.hardware import Device
    from canzona.planner.predict.simulate import Simulation
    from canzona.schedules.format import Schedule

STEP_FIELDS = (
    "name",
    "description",
    "step",
    "compute",
    "comm",
    "exposed_comm",
    "dp_comm",
    "tp_comm",
    "critical_device",
)


def bucket_rows(sim: Simulation) -> list[dict[str, Any]]:
    """canzona's matrix buckets: buffer, index, the collective it runs as, and the predicted
    seconds of its reduction and its gather."""
    from canzona.planner.predict.step import ADAMW_BUFFER

    phases = sim.get("canzona").phases
    gathers = {(s.buffer, s.bucket): s.exchange.seconds() for s in phases.gather}
    return [
        {
            "buffer": s.buffer,
            "bucket": s.bucket,
            "collective": s.collective,
            "reduce_s": s.exchange.seconds(),
            "gather_s": gathers.get((s.buffer, s.bucket), 0.0),
        }
        for s in phases.reduce
        if s.buffer != ADAMW_BUFFER
    ]


def simulation_dict(sim: Simulation) -> dict[str, Any]:
    """A simulation as plain data (seconds; ratios are step / canzona's step, and iteration /
    canzona's iteration)."""
    ratios, iteration_ratios = sim.ratios(), sim.iteration_ratios()
    data: dict[str, Any] = {
        "model": sim.model,
        "tp": sim.tp,
        "dp": sim.dp,
        "ep": sim.ep,
        "optimizer": sim.optimizer,
        "update": sim.update,
        "precision": sim.precision,
        "hardware": asdict(sim.hardware),
        "time_model": sim.time_model,
        "fused": sim.fused,
        "dp_collectives": sim.dp_collectives,
        "strategies": [
            {
                **{key: getattr(s, key) for key in STEP_FIELDS},
                "optimizer_stage": s.optimizer_stage,
                "ratio": ratios[s.name],
            }
            for s in sim.strategies
        ],
        "buckets": bucket_rows(sim),
    }
    if sim.training is not None:
        data["training"] = {
            **asdict(sim.training),
            "micro_batches": sim.training.validate(sim.dp),
            "train_flops": sim.hardware.training_flops(),
        }
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
    from canzona.planner.predict.hardware import CPU_GPUS_PER_NODE

    hw = sim.hardware
    lines = [
        f"{sim.model}  tp {sim.tp} x dp {sim.dp}"
        + (f" (ep {sim.ep})" if sim.ep > 1 else "")
        + f"  {sim.optimizer}  on {hw.name}",
        f"compute: {_pricing(sim.time_model)}; {sim.optimizer}: {sim.update}, "
        f"{hw.rate(sim.precision) / 1e12:.3g} TFLOP/s matrix, {hw.memory_bandwidth / 1e9:.3g} GB/s memory",
        f"network: {hw.intra_bandwidth / 1e9:.3g} GB/s intra-node, {hw.inter_bandwidth / 1e9:.3g} GB/s inter-node "
        f"per direction, "
        + ("all on one host" if hw.gpus_per_node >= CPU_GPUS_PER_NODE else f"{hw.gpus_per_node} per node")
        + f", α {hw.latency * 1e6:.3g} µs per step",
        f"source: {hw.source}",
        "DP collectives: "
        + ("one fused exchange per buffer" if sim.fused else "one per bucket")
        + (
            "; canzona's matrix buckets as the schedule records them"
            if sim.dp_collectives == AS_SCHEDULED
            else f"; every canzona matrix bucket as {sim.dp_collectives}"
        ),
    ]
    if sim.training is not None:
        tr, canzona = sim.training, sim.iteration("canzona")
        lines.append(
            f"training: global batch {tr.global_batch} x {tr.seq_len} tokens, {tr.validate(sim.dp)} micro-batches "
            f"per DP rank; forward+backward {hw.training_flops() / 1e12:.3g} TFLOP/s per device "
            "(6 x params x tokens)"
        )
        lines.append(
            "overlap, the same for every strategy that has such collectives: gradient reduction "
            + ("overlapped with backward" if canzona.overlap_grad else "after backward")
            + ", parameter gather "
            + ("overlapped with the next forward" if canzona.overlap_param else "before the step returns")
            + " (defaults: the runtime's and Megatron-Core's, --overlap-param-gather to change)"
        )
    return lines + [""]


def _step_table(sim: Simulation) -> str:
    ratios = sim.ratios()
    unit, scale = table_unit(max(s.step for s in sim.strategies))
    header = [
        "strategy",
        f"step {unit}",
        f"compute {unit}",
        f"comm {unit}",
        f"exposed {unit}",
        f"DP comm {unit}",
        f"optimizer {unit}",
        "vs canzona",
        "critical device",
    ]
    rows = [
        [
            s.name,
            *(
                f"{value / scale:.3f}"
                for value in (s.step, s.compute, s.comm, s.exposed_comm, s.dp_comm, s.optimizer_stage)
            ),
            f"{ratios[s.name]:.2f}x",
            str(s.critical_device),
        ]
        for s in sim.strategies
    ]
    return _table(header, rows)


def _iteration_table(sim: Simulation) -> str:
    ratios = sim.iteration_ratios()
    unit, scale = table_unit(max(it.iteration for it in sim.iterations))
    header = [
        "strategy",
        f"iteration {unit}",
        f"fwd+bwd {unit}",
        f"exposed reduce {unit}",
        f"optimizer {unit}",
        f"exposed gather {unit}",
        "vs canzona",
        "overlap (grad, param)",
    ]
    rows = [
        [
            it.name,
            *(
                f"{value / scale:.3f}"
                for value in (it.iteration, it.forward_backward, it.exposed_reduce, it.optimizer, it.exposed_gather)
            ),
            f"{ratios[it.name]:.2f}x",
            f"{'yes' if it.overlap_grad else 'no'}, {'yes' if it.overlap_param else 'no'}",
        ]
        for it in sim.iterations
    ]
    return _table(header, rows)


def _collective_lines(sim: Simulation) -> list[str]:
    """Per matrix buffer and collective: canzona's buckets and their predicted seconds."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in bucket_rows(sim):
        groups.setdefault((row["buffer"], row["collective"]), []).append(row)
    lines = []
    for (buffer, collective), rows in sorted(groups.items()):
        seconds = sum(row["reduce_s"] + row["gather_s"] for row in rows)
        unit, scale = table_unit(seconds)
        indices = index_ranges([row["bucket"] for row in rows])
        lines.append(f"  {buffer} buckets {indices}: {collective}, {seconds / scale:.3f} {unit} (reduce + gather)")
    return ["canzona's DP collectives per bucket:", *lines, ""] if lines else []


def simulation_text(sim: Simulation) -> str:
    """The `canzona simulate` report: the optimizer step, then (with a training setup) the iteration."""
    lines = _header(sim) + _collective_lines(sim) + ["optimizer step (nothing overlapped):", _step_table(sim)]
    lines += [
        "",
        "compute/comm/exposed: the critical device's (exposed = step - compute); optimizer = step "
        "without DP collectives; vs canzona: this strategy's time over canzona's (above 1: canzona is faster).",
    ]
    if sim.iterations:
        lines += [
            "",
            "training iteration (every strategy's DP collectives overlapped alike, where it has them):",
            _iteration_table(sim),
            "",
            "optimizer: fetches + optimizer stage + publishing broadcasts, which nothing overlaps; "
            "ddp-adamw is a reference (AdamW, not a matrix optimizer).",
        ]
    return "\n".join(lines)


def _check_network(
    gpus_per_node: int | None,
    intra_gbps: float | None,
    inter_gbps: float | None,
    latency_us: float | None,
    train_tflops: float | None,
) -> None:
    from canzona.planner.spec import PlanError

    if gpus_per_node is not None and gpus_per_node < 1:
        raise PlanError(f"gpus per node must be >= 1, got {gpus_per_node}")
    for label, value in (("intra-gbps", intra_gbps), ("inter-gbps", inter_gbps), ("train-tflops", train_tflops)):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise PlanError(f"--{label} must be a finite number > 0, got {value}")
    if latency_us is not None and not (latency_us >= 0 and math.isfinite(latency_us)):
        raise PlanError(f"--latency-us must be a finite number >= 0, got {latency_us}")


def schedule_device(
    schedule: Schedule,
    device: str,
    network: tuple[float | None, float | None, int | None, float | None] = (None,) * 4,
    train_tflops: float | None = None,
) -> Device:
    """The device (`--device` value) a schedule is priced on, with the network overrides (intra
    and inter GB/s, GPUs per node, latency µs) and training rate given; a CPU profile is shared
    by every rank of the schedule's layout."""
    from dataclasses import replace

    from canzona.planner.predict.hardware import resolve_device, shared_host

    chosen = resolve_device(device, *network)
    if train_tflops is not None:
        hw = chosen.hardware
        chosen = replace(
            chosen,
            hardware=replace(
                hw, train_flops=train_tflops * 1e12, source=f"{hw.source}; overridden: train_flops={train_tflops:g}e12"
            ),
        )
    if chosen.profile is not None and chosen.profile.device == "cpu":
        # Every rank of a CPU run shares this host: the profile's measured contention applies.
        chosen = shared_host(chosen, schedule.request.tp * schedule.request.dp)
    return chosen


def optimizer_config(schedule: Schedule) -> OptimizerConfig:
    """The planner's view of the schedule's optimizer settings."""
    from canzona.planner.partition.costs import OptimizerConfig

    opt = schedule.request.optimizer
    return OptimizerConfig(**opt.model_dump())


def simulate(
    file: Annotated[str, typer.Argument(metavar="SCHEDULE", help=SCHEDULE_HELP)],
    device: Annotated[str, typer.Option(help=DEVICE_HELP)] = "h100",
    intra_gbps: Annotated[
        float | None, typer.Option(help="Intra-node bandwidth, GB/s (gigabytes) per direction per device.")
    ] = None,
    inter_gbps: Annotated[
        float | None, typer.Option(help="Inter-node bandwidth, GB/s (gigabytes) per direction per device.")
    ] = None,
    gpus_per_node: Annotated[int | None, typer.Option(help="Devices per node.")] = None,
    latency_us: Annotated[float | None, typer.Option(help="α: microseconds per collective step.")] = None,
    fused: Annotated[
        bool, typer.Option("--fused", help="One DP collective per buffer instead of one per bucket.")
    ] = False,
    dp_collectives: Annotated[
        str,
        typer.Option(
            help=(
                "canzona's matrix buckets: schedule (each bucket's recorded collective, the runtime's default), or "
                "ring, rooted or all_to_all for every bucket."
            )
        ),
    ] = AS_SCHEDULED,
    global_batch: Annotated[
        int | None,
        typer.Option(
            help=(
                f"Iteration: sequences per optimizer step, over all DP ranks (default: {DEFAULT_GLOBAL_BATCH}, "
                "rounded up to a multiple of dp)."
            )
        ),
    ] = None,
    seq_len: Annotated[int, typer.Option(help="Iteration: tokens per sequence.")] = DEFAULT_SEQ_LEN,
    micro_batches: Annotated[
        int | None, typer.Option(help="Iteration: forward/backward passes per DP rank (default: global batch / dp).")
    ] = None,
    overlap_grad_reduce: Annotated[
        bool, typer.Option(help="Every strategy reduces gradients during backward (the runtime's default).")
    ] = True,
    overlap_param_gather: Annotated[
        bool,
        typer.Option(
            help=(
                "Every strategy with per-bucket parameter gathers runs them during the next forward (a runtime option)."
            )
        ),
    ] = False,
    train_tflops: Annotated[
        float | None,
        typer.Option(help="Achieved training forward+backward TFLOP/s per device (default: the device model's)."),
    ] = None,
    routed_fraction: Annotated[
        float | None, typer.Option(help="MoE: top_k / num_experts (default: from the model's preset or config).")
    ] = None,
    step_only: Annotated[
        bool, typer.Option("--step-only", help="Predict the optimizer step only, not the iteration.")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Predict the optimizer step and the training iteration of the schedule and of every baseline."""
    import dataclasses

    from canzona.planner.plan import TrainingSetup
    from canzona.planner.predict.iteration import check_routed_fraction
    from canzona.planner.predict.simulate import simulate as run_simulation
    from canzona.planner.request import default_global_batch
    from canzona.planner.spec import PlanError

    _check_network(gpus_per_node, intra_gbps, inter_gbps, latency_us, train_tflops)
    if dp_collectives not in DP_COLLECTIVE_MODES:
        raise PlanError(f"--dp-collectives must be one of {', '.join(DP_COLLECTIVE_MODES)}, got {dp_collectives!r}")
    refuse_unless(
        not step_only,
        (
            "global_batch",
            "seq_len",
            "micro_batches",
            "overlap_grad_reduce",
            "overlap_param_gather",
            "train_tflops",
            "routed_fraction",
        ),
        "--step-only predicts no training iteration",
    )
    device = device_option(device)
    training = (
        None
        if step_only
        else TrainingSetup(DEFAULT_GLOBAL_BATCH if global_batch is None else global_batch, seq_len, micro_batches)
    )
    if training is not None:
        training.check_values()
    if routed_fraction is not None:
        check_routed_fraction(routed_fraction)
    schedule = load_schedule(file)  # every option is checked before this, the command's real work
    if schedule.request.sharding == "fsdp":
        refuse_unless(
            False,
            (
                "global_batch",
                "seq_len",
                "micro_batches",
                "overlap_grad_reduce",
                "overlap_param_gather",
                "train_tflops",
                "routed_fraction",
                "fused",
                "dp_collectives",
            ),
            "FSDP schedules are simulated for the optimizer step only (FSDP2's own collectives are the same "
            "for every optimizer)",
        )
        _simulate_fsdp(schedule, device, (intra_gbps, inter_gbps, gpus_per_node, latency_us), as_json)
        return
    if routed_fraction is not None:
        from canzona.planner.predict.iteration import expert_indices

        refuse_unless(
            bool(expert_indices(schedule)), ("routed_fraction",), f"{schedule.request.model.name} has no MoE experts"
        )
    if training is not None:
        if global_batch is None:
            training = dataclasses.replace(training, global_batch=default_global_batch(schedule.request.dp))
        training.validate(schedule.request.dp)
    chosen = schedule_device(schedule, device, (intra_gbps, inter_gbps, gpus_per_node, latency_us), train_tflops)
    config = optimizer_config(schedule)
    sim = run_simulation(
        schedule,
        chosen.hardware,
        chosen.time_model(config),
        fused=fused,
        dp_collectives=dp_collectives,
        training=training,
        overlap_grad_reduce=overlap_grad_reduce,
        overlap_param_gather=overlap_param_gather,
        routed_fraction=routed_fraction,
    )
    echo(json.dumps(simulation_dict(sim), indent=2) if as_json else simulation_text(sim))


def _simulate_fsdp(schedule: Schedule, device: str, network: tuple[Any, ...], as_json: bool) -> None:
    """The optimizer step of an FSDP schedule and its baselines (`planner/predict/simulate_fsdp.py`)."""
    from canzona.planner.predict.simulate_fsdp import simulate_fsdp

    chosen = schedule_device(schedule, device, network, None)
    sim = simulate_fsdp(schedule, chosen.hardware, chosen.time_model(optimizer_config(schedule)))
    canzona = sim.get("canzona").step
    if as_json:
        echo(
            json.dumps(
                {
                    "model": sim.model,
                    "tp": sim.tp,
                    "dp": sim.dp,
                    "dp_replicate": sim.dp_replicate,
                    "optimizer": sim.optimizer,
                    "device": sim.hardware.name,
                    "num_groups": sim.num_groups,
                    "strategies": [asdict(s) for s in sim.strategies],
                },
                indent=2,
            )
        )
        return
    hsdp = f" (HSDP {sim.dp_replicate} replicas)" if sim.dp_replicate > 1 else ""
    lines = [
        f"{sim.model}  FSDP tp {sim.tp} x dp {sim.dp}{hsdp}  {sim.optimizer}  on {sim.hardware.name}  "
        f"{sim.num_groups} micro-groups",
        "predicted optimizer step (FSDP2's own collectives excluded)",
        "",
    ]
    unit, scale = table_unit(max(s.step for s in sim.strategies))
    rows = [
        [s.name, f"{s.step / scale:.3f}", f"{s.step / canzona:.2f}x" if canzona else "-", s.description]
        for s in sim.strategies
    ]
    lines.append(_table(["strategy", f"step {unit}", "vs canzona", "what"], rows))
    echo("\n".join(lines))
