"""Plain-text and JSON renderings of presets and schedules for the terminal."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from canzona.cli.wording import duration, percent, plural
from canzona.schedules.costs import runs_gram, update_label
from canzona.schedules.limits import REPLICATED_UPDATE
from canzona.schedules.splits import as_blocks, submatrices

if TYPE_CHECKING:  # only named: `canzona -h` loads neither
    from canzona.planner.sources.architecture import Architecture
    from canzona.schedules.format import Schedule

BAR_WIDTH = 40
MAX_BAR_ROWS = 32  # up to this many ranks get a row each; more are shown as RANGE_ROWS ranges
RANGE_ROWS = 16
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
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [header, *rows]
    ]
    return "\n".join(lines)


def presets_table(rows: list[dict[str, Any]]) -> str:
    """The `canzona models` table."""
    header = ["model", "params", "layers", "hidden", "heads", "kv", "experts", "vocab", "tied"]
    body = [
        [
            r["name"],
            f"{r['params_b']:.3f}B",
            r["layers"],
            r["hidden"],
            r["heads"],
            r["kv_groups"],
            r["experts"] or "-",
            r["vocab"],
            "yes" if r["tied"] else "no",
        ]
        for r in rows
    ]
    return _table(header, body)


def predicted_step(schedule: Schedule) -> dict[str, Any] | None:
    """The schedule's predicted step, what bounds it and its lower bound
    (`canzona.planner.predict.headline`); None for FSDP schedules."""
    if schedule.request.sharding == "fsdp":
        return None
    from dataclasses import asdict

    from canzona.planner.predict.headline import step_headline

    headline = step_headline(schedule)
    return {**asdict(headline), "over_bound": headline.over_bound}


def step_line(step: dict[str, Any]) -> str:
    """One line: the predicted step, what bounds it, and how far above its lower bound."""
    return (
        f"predicted step {duration(step['step_s'])} on {step['device']}, bound by {step['bound']} "
        f"(largest part: {step['top']}, {duration(step['top_s'])}; the critical device computes "
        f"{duration(step['compute_s'])}); {step['over_bound']:.3f}x its lower bound {duration(step['lower_bound_s'])}"
    )


def _notable_update(optimizer: str, update: str) -> bool:
    """Whether the matrix updates (`update_label`) run other than Muon's default (standard
    Newton-Schulz in the device's default precision) or Shampoo's and SOAP's fp32."""
    if optimizer != "muon" or not update:
        return False
    return update.startswith("gram") or not update.endswith("bf16")


def gram_counts(schedule: Schedule) -> tuple[int, int]:
    """(submatrices that run Gram Newton-Schulz, all Muon submatrices): the fallback the plan
    is priced with (0 run Gram under the standard method)."""
    method = schedule.request.optimizer.ns_method
    pieces = [
        piece
        for e in schedule.params
        if e.optimizer == "matrix"
        for piece in submatrices(e.shape, as_blocks(e.row_blocks))
    ]
    return sum(runs_gram(rows, cols, method) for rows, cols in pieces), len(pieces)


def plan_summary(schedule: Schedule, path: str, seconds: float, written: bool = True) -> dict[str, Any]:
    """Headline figures of a plan just made; `written`: False when its file already held it."""
    req, dp = schedule.request, schedule.metrics.dp
    counts = gram_counts(schedule)
    return {
        "predicted_step": predicted_step(schedule),
        "output": path,
        "written": written,
        "model": req.model.name,
        "tp": req.tp,
        "dp": req.dp,
        "optimizer": req.optimizer.name,
        "update": update_label(req.optimizer, counts=counts),
        "gram_matrices": counts[0],
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
        "tp_update": schedule.tp.update,
        "num_groups": schedule.metrics.tp.num_groups,
        "tp_efficiency": schedule.metrics.tp.efficiency,
        "device_imbalance": schedule.metrics.tp.device_imbalance,
        "cooperative": schedule.metrics.tp.cooperative,
        "device_gap": schedule.metrics.tp.device_gap,
        "device_lower_bound": schedule.metrics.tp.device_lower_bound,
        "solver": schedule.metrics.solver.model_dump() if schedule.metrics.solver else None,
        "alpha_search": [t.model_dump() for t in schedule.metrics.alpha_search or []],
        "alpha_device": req.alpha_device,
        "bucket_size": req.bucket_size,
        "bucket_search": schedule.metrics.bucket_search.model_dump() if schedule.metrics.bucket_search else None,
        "bucket_device": req.bucket_device,
        "sharding": req.sharding,
        "dp_replicate": req.dp_replicate,
        "seconds": round(seconds, 3),
    }


def search_candidates(trials: list[tuple[str, float]], chosen: int, prefix: str = "") -> str:
    """What an automatic search predicted: the chosen candidate's time, then every other one's
    difference from it, to the thousandth of a millisecond, so that the winner is visible even
    where all of them round to the same seconds."""
    label, best = trials[chosen]
    others = ", ".join(
        f"{name}: {_difference(seconds - best)}" for index, (name, seconds) in enumerate(trials) if index != chosen
    )
    return f"{duration(best)} at {prefix}{label}" + (f"; {others}" if others else "")


def _difference(seconds: float) -> str:
    """A signed time difference: `+0.360 ms`, `-0.004 ms`, or `+12 ns` below a microsecond."""
    if seconds == 0:
        return "same"
    return f"{seconds * 1e3:+.3f} ms" if abs(seconds) >= 1e-6 else f"{seconds * 1e9:+.0f} ns"


def _fsdp_layout(tp: int, dp: int, replicate: int) -> str:
    """'FSDP 4 shards' or 'HSDP 2 replicas x 2 shards', with the hosts of a matrix."""
    shards = dp // replicate
    mode = f"HSDP {replicate} replicas x {shards} shards" if replicate > 1 else f"FSDP {shards} shards"
    return f"{mode}: hosts over DP shard x TP = {shards * tp} devices"


def summary_text(summary: dict[str, Any]) -> str:
    """Short human summary of `plan_summary`."""
    notable = _notable_update(summary["optimizer"], summary["update"])
    lines = [
        f"wrote {summary['output']}"
        if summary.get("written", True)
        else f"unchanged {summary['output']} (it held this plan)",
        f"{summary['model']}  tp {summary['tp']} x dp {summary['dp']}  {summary['optimizer']}  "
        f"cost {summary['cost']}  alpha {summary['alpha']:g}",
        *([f"matrix updates: {summary['update']}"] if notable else []),
        *([step_line(summary["predicted_step"])] if summary.get("predicted_step") else []),
        f"{plural(summary['num_matrix_params'], 'matrix parameter')} in {plural(summary['num_buckets'], 'bucket')}, "
        f"method {summary['method']}",
        f"DP imbalance {summary['imbalance']:.4f}  gap {percent(summary['gap'])} above the lower bound  "
        f"padding overhead {summary['padding_overhead']:.2f}x",
        "baselines, max load / lower bound: "
        + ", ".join(f"{name} {1 + b['gap']:.3f}" for name, b in summary["baselines"].items()),
        f"TP {summary['tp_mode']}: {plural(summary['num_groups'], 'micro-group')}, efficiency "
        f"{summary['tp_efficiency']:.3f}, device imbalance {summary['device_imbalance']:.3f}"
        + (
            f", {plural(summary['cooperative'], 'matrix', 'matrices')} hosted cooperatively"
            if summary["cooperative"]
            else ""
        )
        + _device_gap_text(summary["device_gap"]),
        *([REPLICATED_TEXT] if summary.get("tp_update") == REPLICATED_UPDATE else []),
        f"planned in {duration(summary['seconds'])}",
    ]
    if summary.get("sharding") == "fsdp":
        lines[1] = (
            f"{summary['model']}  tp {summary['tp']} x dp {summary['dp']}  {summary['optimizer']}  "
            f"cost {summary['cost']}"
        )
        lines[2] = f"{plural(summary['num_matrix_params'], 'matrix parameter')}, " + _fsdp_layout(
            summary["tp"], summary["dp"], summary["dp_replicate"]
        )
    after_step = 2 + notable + bool(summary.get("predicted_step"))  # the searches' lines follow the headline
    if summary["alpha_search"]:
        objective = "iteration" if summary["alpha_search"][0].get("predicted_iteration_s") is not None else "step"
        tried = [(f"{t['alpha']:g}", t[f"predicted_{objective}_s"]) for t in summary["alpha_search"]]
        chosen = next(i for i, t in enumerate(summary["alpha_search"]) if t["alpha"] == summary["alpha"])
        lines.insert(
            after_step,
            f"alpha chosen by the simulator on {summary['alpha_device']}: predicted {objective} "
            f"{search_candidates(tried, chosen, 'alpha ')} (equal times go to the larger alpha)",
        )
    if summary["bucket_search"]:
        from canzona.planner.predict.auto_bucket import size_label

        search = summary["bucket_search"]
        tried = [(size_label(t["bucket_size"]), t["predicted_iteration_s"]) for t in search["trials"]]
        chosen = next(i for i, t in enumerate(search["trials"]) if t["bucket_size"] == summary["bucket_size"])
        lines.insert(
            after_step,
            f"bucket size chosen by the simulator on {summary['bucket_device']}: {search['reason']} "
            f"(predicted iteration {search_candidates(tried, chosen)})",
        )
    solver = summary["solver"]
    if solver:
        lines.insert(
            -1,
            (
                f"CP-SAT: DP {solver['dp_status']} (objective {solver['dp_objective']:.4g}, bound "
                f"{solver['dp_bound']:.4g}, {'accepted' if solver['dp_accepted'] else 'greedy kept'}); "
                f"TP hosts improved in {solver['tp_groups_improved']} of {plural(solver['tp_groups_refined'], 'group')}"
            ),
        )
    return "\n".join(lines)


def _bar(label: str, ratio: float) -> str:
    filled = round(BAR_WIDTH * min(ratio, 2.0) / 2.0)
    return f"{label:>9}  {'#' * filled:<{BAR_WIDTH}}  {ratio:.3f}"


def _bars(values: list[float], reference: float, what: str) -> list[str]:
    """A bar per rank, `value / reference` (full bar = 2x), under a title naming `what`; past
    MAX_BAR_ROWS ranks, RANGE_ROWS ranges of ranks, each drawn at its maximum, and a summary."""
    ratios = [value / reference if reference else 0.0 for value in values]
    if len(ratios) <= MAX_BAR_ROWS:
        return [f"{what} (1.000 = mean, full bar = 2x mean):"] + [_bar(str(i), r) for i, r in enumerate(ratios)]
    step = -(-len(ratios) // RANGE_ROWS)
    lines = [
        f"{what} (1.000 = mean, full bar = 2x mean), {step} ranks a row, each row the maximum of its range; "
        "--rank R shows one device:"
    ]
    for start in range(0, len(ratios), step):
        chunk = ratios[start : start + step]
        lines.append(_bar(f"{start}-{start + len(chunk) - 1}", max(chunk)))
    idle = sum(1 for value in values if value == 0)
    lines.append(
        f"{'':>9}  min {min(ratios):.3f}, median {statistics.median(ratios):.3f}, max {max(ratios):.3f}"
        + (f"; {idle} of {len(ratios)} idle" if idle else "")
    )
    return lines


def _device_gap_text(gap: float | None) -> str:
    """', device gap X above the device lower bound', or nothing for files without it."""
    return "" if gap is None else f", device gap {percent(gap)} above the device lower bound"


def index_ranges(indices: list[int]) -> str:
    """Bucket indices as ranges: 0-3, 7, 9-12."""
    spans: list[list[int]] = []
    for index in indices:
        if spans and spans[-1][1] == index - 1:
            spans[-1][1] = index
        else:
            spans.append([index, index])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


def bucket_collectives(schedule: Schedule) -> dict[str, dict[str, list[int]]]:
    """Per matrix buffer ("matrix", "expert"), the buckets of each recorded collective."""
    out: dict[str, dict[str, list[int]]] = {}
    for name, buckets in (("matrix", schedule.dp.buckets), ("expert", schedule.dp.expert_buckets)):
        for bucket in buckets:
            out.setdefault(name, {}).setdefault(bucket.collective, []).append(bucket.index)
    return out


def collective_lines(schedule: Schedule) -> list[str]:
    """One line per matrix buffer: which buckets the runtime reduces and gathers how."""
    lines = []
    for name, chosen in bucket_collectives(schedule).items():
        parts = "; ".join(f"{collective} {index_ranges(indices)}" for collective, indices in sorted(chosen.items()))
        lines.append(f"{name} buckets by collective: {parts}")
    return lines


def show_text(schedule: Schedule) -> str:
    """The `canzona show` report."""
    req, dp = schedule.request, schedule.metrics.dp
    header = (
        f"{req.model.name}  tp {req.tp} x dp {req.dp}  {req.optimizer.name}  cost {req.cost}  "
        f"alpha {req.alpha:g}  method {dp.method}" + ("  order free" if req.order == "free" else "")
    )
    if req.sharding == "fsdp":
        header = f"{req.model.name}  tp {req.tp} x dp {req.dp}  {req.optimizer.name}  cost {req.cost}  " + _fsdp_layout(
            req.tp, req.dp, req.dp_replicate
        )
    step = predicted_step(schedule)
    update = update_label(req.optimizer, counts=gram_counts(schedule))
    lines = [header, *([f"matrix updates: {update}"] if _notable_update(req.optimizer.name, update) else [])]
    lines += [*([step_line(step)] if step else []), "", *_bars(dp.load, dp.mean, "compute load per DP rank")]
    lines += [
        "",
        f"imbalance {dp.imbalance:.4f}  gap {percent(dp.gap)} above the lower bound {dp.lower_bound:.4g} "
        "(no plan of this model and layout does better: mean, largest matrix, pairs of the largest)",
        f"padding overhead {dp.padding_overhead:.2f}x (worst bucket {dp.max_padding_overhead:.2f}x)",
        *collective_lines(schedule),
        f"gradient slice per rank: max {max(dp.slice_bytes) / GIB:.3f} GiB, min {min(dp.slice_bytes) / GIB:.3f} GiB",
        f"optimizer state per DP rank (TP group): max {max(dp.state_bytes) / GIB:.2f} GiB, "
        f"min {min(dp.state_bytes) / GIB:.2f} GiB",
        "",
    ]
    rows = [["canzona", f"{1 + dp.gap:.3f}", f"{dp.imbalance:.3f}", "1.00", f"{dp.padding_overhead:.2f}x"]]
    rows += [
        [
            name,
            f"{1 + s.gap:.3f}",
            f"{s.imbalance:.3f}",
            f"{s.redundancy:.2f}",
            "-" if s.padding_overhead is None else f"{s.padding_overhead:.2f}x",
        ]
        for name, s in dp.baselines.items()
    ]
    lines.append(_table(["strategy", "max/bound", "imbalance", "redundancy", "padding"], rows))
    return "\n".join(lines + [""] + _tp_lines(schedule))


REPLICATED_TEXT = (
    "TP update replicated: every TP rank all-gathers and updates every matrix its DP rank owns (no update "
    "scattered back; each holds those matrices' full state), the micro-groups unused"
)


def _tp_lines(schedule: Schedule) -> list[str]:
    tp, devices = schedule.metrics.tp, schedule.metrics.device
    lines = [
        f"TP micro-groups ({tp.mode}, capacity {schedule.tp.group_bytes / (1 << 20):.0f} MiB per host): "
        f"critical path {tp.critical_time:.4g} vs lower bound {tp.critical_lower_bound:.4g}"
        + (f"; {plural(tp.cooperative, 'matrix', 'matrices')} hosted cooperatively" if tp.cooperative else ""),
        *([REPLICATED_TEXT] if schedule.tp.update == REPLICATED_UPDATE else []),
    ]
    s = tp.modes[tp.mode]  # older files also hold other modes' scores, which nothing re-checks: not shown
    rows = [
        [
            tp.mode,
            str(s.num_groups),
            f"{s.efficiency:.3f}",
            f"{s.critical_time / tp.critical_lower_bound if tp.critical_lower_bound else 1:.3f}",
            f"{s.device_imbalance:.3f}",
            f"{s.max_saturation:.2f}",
        ]
    ]
    lines.append(_table(["mode", "groups", "efficiency", "critical/bound", "device imbalance", "max saturation"], rows))
    loads = [d.load for d in devices]
    lines += ["", *_bars(loads, sum(loads) / len(loads), "compute load per device")]
    if tp.device_lower_bound is not None and tp.device_gap is not None:
        lines.append(
            f"worst device {tp.worst_device_load:.4g}: gap {percent(tp.device_gap)} above the device lower bound "
            f"{tp.device_lower_bound:.4g} (no plan does better: mean work, DP bound / tp, the smallest piece a "
            "team leaves of the largest matrix)"
        )
    peaks = [d.peak_bytes for d in devices if d.peak_bytes is not None]
    peak = f"predicted peak memory max {max(peaks) / GIB:.2f} GiB (above params + grads), " if peaks else ""
    lines.append(
        f"per device: {peak}state max {max(d.state_bytes for d in devices) / GIB:.2f} GiB, "
        f"sent max {max(d.bytes_sent for d in devices) / GIB:.2f} GiB, "
        f"received max {max(d.bytes_received for d in devices) / GIB:.2f} GiB per step"
    )
    return lines


def metrics_data(schedule: Schedule) -> dict[str, Any]:
    """The schedule's metrics as plain data, the TP modes reduced to the chosen one (older files
    also hold the others' scores, which nothing re-checks)."""
    data = schedule.metrics.model_dump(mode="json")
    data["tp"]["modes"] = {schedule.metrics.tp.mode: data["tp"]["modes"][schedule.metrics.tp.mode]}
    return data


def rank_part(schedule: Schedule, rank: int) -> dict[str, Any]:
    """One device's part of the schedule as plain data: owned matrices and buffer slices,
    hosted tasks per micro-group, load, state and bytes per step."""
    req = schedule.request
    dp_rank, tp_rank = divmod(rank, req.tp)
    device = schedule.metrics.device[rank]
    if req.sharding == "fsdp":  # one plan for every replica; hosts are fragment ranks (shard · tp + tp rank)
        host = (dp_rank % (req.dp // req.dp_replicate)) * req.tp + tp_rank
        groups: list[dict[str, Any]] = [
            {
                "index": g.index,
                "tasks": len(g.params),
                "makespan": g.makespan,
                "saturation": g.saturation,
                "hosted": [name for name, h in zip(g.params, g.hosts) if h == host],
                "teamed": [],
            }
            for g in schedule.tp.ranks[0].groups
        ]
        return {
            "rank": rank,
            "dp_rank": dp_rank,
            "tp_rank": tp_rank,
            "model": req.model.name,
            "tp": req.tp,
            "dp": req.dp,
            "load": device.load,
            "state_bytes": device.state_bytes,
            "peak_bytes": device.peak_bytes,
            "bytes_sent": device.bytes_sent,
            "bytes_received": device.bytes_received,
            "owned": [n for g in groups for n in g["hosted"]],
            "slices": [],
            "groups": groups,
            "sharding": req.sharding,
        }
    slices = [
        {
            "bucket": bucket.index,
            "start": bucket.cuts[dp_rank],
            "stop": bucket.cuts[dp_rank + 1],
            "elements": bucket.cuts[dp_rank + 1] - bucket.cuts[dp_rank],
        }
        for bucket in schedule.dp.buckets
        if bucket.cuts[dp_rank + 1] > bucket.cuts[dp_rank]
    ]
    groups = [
        {
            "index": group.index,
            "tasks": len(group.params),
            "makespan": group.makespan,
            "saturation": group.saturation,
            "hosted": [
                name
                for name, host in zip(group.params, group.hosts)
                if host == tp_rank or tp_rank in teams.get(name, ())
            ],
            "teamed": [name for name in group.params if tp_rank in teams.get(name, ())],
        }
        for group in schedule.tp.ranks[dp_rank].groups
        for teams in ({team.param: team.hosts for team in group.teams},)
    ]
    return {
        "rank": rank,
        "dp_rank": dp_rank,
        "tp_rank": tp_rank,
        "model": req.model.name,
        "tp": req.tp,
        "dp": req.dp,
        "load": device.load,
        "state_bytes": device.state_bytes,
        "peak_bytes": device.peak_bytes,
        "bytes_sent": device.bytes_sent,
        "bytes_received": device.bytes_received,
        "owned": [p.name for p in schedule.params if p.owner == dp_rank],
        "slices": slices,
        "groups": groups,
    }


def rank_text(part: dict[str, Any]) -> str:
    """`rank_part` for the terminal."""
    lines = [
        f"device {part['rank']} = dp rank {part['dp_rank']}, tp rank {part['tp_rank']} of {part['model']} "
        f"tp {part['tp']} x dp {part['dp']}",
        f"compute load {part['load']:.4g}  state {part['state_bytes'] / GIB:.3f} GiB  "
        + (f"peak memory {part['peak_bytes'] / GIB:.3f} GiB  " if part.get("peak_bytes") is not None else "")
        + f"sent {part['bytes_sent'] / GIB:.3f} GiB  received {part['bytes_received'] / GIB:.3f} GiB per step",
        "",
        f"owns {plural(len(part['owned']), 'matrix', 'matrices')}; slices of the matrix buffer:",
    ]
    if part.get("sharding") == "fsdp":
        lines[-1] = f"hosts {plural(len(part['owned']), 'matrix', 'matrices')} (FSDP: no buffer slices)"
    lines += [
        f"  bucket {s['bucket']}: [{s['start']}, {s['stop']})  {plural(s['elements'], 'element')}"
        for s in part["slices"]
    ]
    lines += ["", "micro-groups (tasks hosted here marked *):"]
    for group in part["groups"]:
        lines.append(
            f"  group {group['index']}: {plural(group['tasks'], 'task')}, makespan {group['makespan']:.4g}, "
            f"saturation {group['saturation']:.2f}, {len(group['hosted'])} hosted here"
        )
        lines += [
            f"    * {name}" + (" (a slice: hosted by a team)" if name in group["teamed"] else "")
            for name in group["hosted"]
        ]
    return "\n".join(lines)
