"""Plain-text and JSON renderings of presets and schedules for the terminal."""

from __future__ import annotations

from typing import Any

from canzona.planner.sources.catalog import Architecture
from canzona.schedules.format import Schedule

BAR_WIDTH = 40
MAX_BAR_ROWS = 64
GIB = 1 << 30


def preset_row(name: str, arch: Architecture, num_params: int) -> dict[str, Any]:
    """One preset as a flat record."""
    return {
        "name": name,
        "params_b": round(num_params / 1e9, 3),
        "layers": arch.num_layers,
        "hidden": arch.h,
        "heads": arch.num_heads,
        "kv_groups": arch.num_kv_groups,
        "experts": arch.num_experts,
        "vocab": arch.vocab,
        "tied": arch.tied_embeddings,
    }


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [header, *rows]]
    return "\n".join(lines)


def presets_table(rows: list[dict[str, Any]]) -> str:
    """The `canzona models` table."""
    header = ["model", "params", "layers", "hidden", "heads", "kv", "experts", "vocab", "tied"]
    body = [
        [r["name"], f"{r['params_b']:.3f}B", r["layers"], r["hidden"], r["heads"], r["kv_groups"], r["experts"] or "-", r["vocab"], "yes" if r["tied"] else "no"]
        for r in rows
    ]
    return _table(header, body)


def plan_summary(schedule: Schedule, path: str, seconds: float) -> dict[str, Any]:
    """Headline figures of a freshly written plan."""
    req, dp = schedule.request, schedule.metrics.dp
    return {
        "output": path,
        "model": req.model.name,
        "tp": req.tp,
        "dp": req.dp,
        "optimizer": req.optimizer.name,
        "cost": req.cost,
        "alpha": req.alpha,
        "num_matrix_params": sum(1 for p in schedule.params if p.owner is not None),
        "num_buckets": len(schedule.dp.buckets),
        "method": dp.method,
        "imbalance": dp.imbalance,
        "gap": dp.gap,
        "lower_bound": dp.lower_bound,
        "padding_overhead": dp.padding_overhead,
        "baselines": {name: {"imbalance": s.imbalance, "gap": s.gap} for name, s in dp.baselines.items()},
        "tp_mode": schedule.metrics.tp.mode,
        "num_groups": schedule.metrics.tp.num_groups,
        "tp_efficiency": schedule.metrics.tp.efficiency,
        "device_imbalance": schedule.metrics.tp.device_imbalance,
        "solver": schedule.metrics.solver.model_dump() if schedule.metrics.solver else None,
        "alpha_search": [t.model_dump() for t in schedule.metrics.alpha_search or []],
        "alpha_device": req.alpha_device,
        "bucket_size": req.bucket_size,
        "bucket_search": schedule.metrics.bucket_search.model_dump() if schedule.metrics.bucket_search else None,
        "bucket_device": req.bucket_device,
        "seconds": round(seconds, 3),
    }


def summary_text(summary: dict[str, Any]) -> str:
    """Short human summary of `plan_summary`."""
    lines = [
        f"wrote {summary['output']}",
        f"{summary['model']}  tp {summary['tp']} x dp {summary['dp']}  {summary['optimizer']}  "
        f"cost {summary['cost']}  alpha {summary['alpha']:g}",
        f"{summary['num_matrix_params']} matrix params in {summary['num_buckets']} buckets, "
        f"method {summary['method']}",
        f"DP imbalance {summary['imbalance']:.4f}  gap {100 * summary['gap']:.2f}% above the lower bound  "
        f"padding overhead {summary['padding_overhead']:.2f}x",
        "baselines, max load / lower bound: "
        + ", ".join(f"{name} {1 + b['gap']:.3f}" for name, b in summary["baselines"].items()),
        f"TP {summary['tp_mode']}: {summary['num_groups']} micro-groups, efficiency "
        f"{summary['tp_efficiency']:.3f}, device imbalance {summary['device_imbalance']:.3f}",
        f"planned in {summary['seconds']:.2f} s",
    ]
    if summary["alpha_search"]:
        objective = "iteration" if summary["alpha_search"][0].get("predicted_iteration_s") is not None else "step"
        tried = ", ".join(f"{t['alpha']:g}: {1e3 * t[f'predicted_{objective}_s']:.1f} ms" for t in summary["alpha_search"])
        lines.insert(2, f"alpha chosen by the simulator on {summary['alpha_device']} (predicted {objective}: {tried})")
    if summary["bucket_search"]:
        from canzona.planner.predict.auto_bucket import size_label

        search = summary["bucket_search"]
        tried = ", ".join(f"{size_label(t['bucket_size'])}: {1e3 * t['predicted_iteration_s']:.1f} ms" for t in search["trials"])
        lines.insert(2, f"bucket size chosen by the simulator on {summary['bucket_device']}: {search['reason']} "
                        f"(predicted iteration: {tried})")
    solver = summary["solver"]
    if solver:
        lines.insert(-1, (
            f"CP-SAT: DP {solver['dp_status']} (objective {solver['dp_objective']:.4g}, bound "
            f"{solver['dp_bound']:.4g}, {'accepted' if solver['dp_accepted'] else 'greedy kept'}); "
            f"TP hosts improved in {solver['tp_groups_improved']} of {solver['tp_groups_refined']} groups"
        ))
    return "\n".join(lines)


def _bars(values: list[float], reference: float) -> list[str]:
    """Rows of `rank  bar  value/reference`; ranges of ranks (their max) when there are many."""
    step = -(-len(values) // MAX_BAR_ROWS)
    rows = []
    for start in range(0, len(values), step):
        chunk = values[start : start + step]
        label = str(start) if step == 1 else f"{start}-{start + len(chunk) - 1}"
        top = max(chunk)
        ratio = top / reference if reference else 0.0
        filled = round(BAR_WIDTH * min(ratio, 2.0) / 2.0)
        rows.append(f"{label:>9}  {'#' * filled:<{BAR_WIDTH}}  {ratio:.3f}")
    return rows


def show_text(schedule: Schedule) -> str:
    """The `canzona show` report."""
    req, dp = schedule.request, schedule.metrics.dp
    header = (
        f"{req.model.name}  tp {req.tp} x dp {req.dp}  {req.optimizer.name}  cost {req.cost}  "
        f"alpha {req.alpha:g}  method {dp.method}"
    )
    ideal = dp.mean
    lines = [header, "", "compute load per DP rank (1.000 = mean, full bar = 2x mean):"]
    lines += _bars(dp.load, ideal)
    lines += [
        "",
        f"imbalance {dp.imbalance:.4f}  gap {100 * dp.gap:.2f}% above lower bound {dp.lower_bound:.4g}",
        f"padding overhead {dp.padding_overhead:.2f}x (worst bucket {dp.max_padding_overhead:.2f}x)",
        f"gradient slice per rank: max {max(dp.slice_bytes) / GIB:.3f} GiB, "
        f"min {min(dp.slice_bytes) / GIB:.3f} GiB",
        f"optimizer state per DP rank (TP group): max {max(dp.state_bytes) / GIB:.2f} GiB, "
        f"min {min(dp.state_bytes) / GIB:.2f} GiB",
        "",
    ]
    rows = [["canzona", f"{1 + dp.gap:.3f}", f"{dp.imbalance:.3f}", "1.00", f"{dp.padding_overhead:.2f}x"]]
    rows += [[name, f"{1 + s.gap:.3f}", f"{s.imbalance:.3f}", f"{s.redundancy:.2f}", "-" if s.padding_overhead is None else f"{s.padding_overhead:.2f}x"] for name, s in dp.baselines.items()]
    lines.append(_table(["strategy", "max/bound", "imbalance", "redundancy", "padding"], rows))
    return "\n".join(lines + [""] + _tp_lines(schedule))


def _tp_lines(schedule: Schedule) -> list[str]:
    tp, devices = schedule.metrics.tp, schedule.metrics.device
    lines = [
        f"TP micro-groups ({tp.mode}, capacity {schedule.tp.group_bytes / (1 << 20):.0f} MiB per host): "
        f"critical path {tp.critical_time:.4g} vs lower bound {tp.critical_lower_bound:.4g}",
    ]
    rows = [
        [mode, str(s.num_groups), f"{s.efficiency:.3f}", f"{s.critical_time / tp.critical_lower_bound if tp.critical_lower_bound else 1:.3f}", f"{s.device_imbalance:.3f}", f"{s.max_saturation:.2f}"]
        for mode, s in tp.modes.items()
    ]
    lines.append(_table(["mode", "groups", "efficiency", "critical/bound", "device imbalance", "max saturation"], rows))
    lines += ["", "compute load per device (1.000 = mean):"]
    loads = [d.load for d in devices]
    lines += _bars(loads, sum(loads) / len(loads))
    lines.append(
        f"per device: state max {max(d.state_bytes for d in devices) / GIB:.2f} GiB, "
        f"sent max {max(d.bytes_sent for d in devices) / GIB:.2f} GiB, "
        f"received max {max(d.bytes_received for d in devices) / GIB:.2f} GiB per step"
    )
    return lines


def rank_text(schedule: Schedule, rank: int) -> str:
    """One device's part of the schedule: owned slices, hosted groups and tasks, bytes."""
    req = schedule.request
    dp_rank, tp_rank = divmod(rank, req.tp)
    device = schedule.metrics.device[rank]
    owned = [p for p in schedule.params if p.owner == dp_rank]
    lines = [
        f"device {rank} = dp rank {dp_rank}, tp rank {tp_rank} of {req.model.name} tp {req.tp} x dp {req.dp}",
        f"compute load {device.load:.4g}  state {device.state_bytes / GIB:.3f} GiB  "
        f"sent {device.bytes_sent / GIB:.3f} GiB  received {device.bytes_received / GIB:.3f} GiB per step",
        "",
        f"owns {len(owned)} matrices; slices of the matrix buffer:",
    ]
    for bucket in schedule.dp.buckets:
        start, stop = bucket.cuts[dp_rank], bucket.cuts[dp_rank + 1]
        if stop > start:
            lines.append(f"  bucket {bucket.index}: [{start}, {stop})  {stop - start} elements")
    lines += ["", "micro-groups (tasks hosted here marked *):"]
    for group in schedule.tp.ranks[dp_rank].groups:
        mine = [name for name, host in zip(group.params, group.hosts) if host == tp_rank]
        lines.append(
            f"  group {group.index}: {len(group.params)} tasks, makespan {group.makespan:.4g}, "
            f"saturation {group.saturation:.2f}, hosts {len(mine)} here"
        )
        lines += [f"    * {name}" for name in mine]
    return "\n".join(lines)
