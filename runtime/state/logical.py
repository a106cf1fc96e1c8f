"""The optimizer state in logical form: per parameter, in full (unsharded) shape, keyed so that
it does not depend on the schedule (DP, TP, α, buckets, micro-groups). The layout is documented
in `canzona.schedules.reshard`; here it meets the runtime's buffers.

Keys: `matrix/<param>/<submatrix>/<field>` (e.g. `matrix/w/0/momentum`, `matrix/w/1/blocks/3/L`),
`adamw/<param>/<exp_avg|exp_avg_sq>` (flattened row-major over the full shape) and, for bf16 /
fp16 parameters, `main/<param>`: the fp32 main copy (full shape for a matrix, rows in canonical
order: its submatrices one after the other; flattened for an AdamW parameter). Each rank holds
some chunks of them (`LogicalTensor`): a hosted matrix's tensors whole, an AdamW parameter's
runs that fall in its equal slices. Tensors are created on the optimizer's device.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch
from torch import Tensor

from canzona.runtime.groups import group_hyperparameters
from canzona.runtime.plan import RankPlan
from canzona.runtime.rules.cooperative import canonical_chunks
from canzona.runtime.rules.optimizers import Hyperparameters, MatrixRule, State
from canzona.runtime.rules.precision import adamw_from_params, from_canonical, to_canonical
from canzona.runtime.state.store import ADAMW_MOMENTS, OptimizerState, matrix_template
from canzona.schedules.limits import MATRIX
from canzona.schedules.reshard import StateLayout, full_runs

STATE_FORMAT = "canzona-logical/1"
Offsets = tuple[int, ...]


@dataclass
class LogicalTensor:
    """One tensor of the logical state: its full `size`, and the chunks held here as
    (offsets into the full tensor, data)."""

    size: tuple[int, ...]
    chunks: list[tuple[Offsets, Tensor]] = field(default_factory=list)


@dataclass(frozen=True)
class AdamwRun:
    """`length` elements of parameter `param`'s AdamW state: at `full` in the logical (flattened
    full) tensor and at `local` in this rank's AdamW state buffers."""

    param: int
    full: int
    local: int
    length: int


@dataclass
class Destination:
    """Where an import writes: the tensors to fill, and the state they become (`main_complete`:
    whether every main copy this rank keeps is among them; else they are rebuilt)."""

    tensors: dict[str, LogicalTensor]
    matrix: dict[int, list[State]]
    adamw: dict[str, Tensor]
    main_matrices: dict[int, Tensor] = field(default_factory=dict)
    main_adamw: Tensor | None = None
    main_complete: bool = False


def matrix_key(name: str, path: str) -> str:
    """The key of one tensor of a matrix's state (`path`: `<submatrix>/<field>`)."""
    return f"matrix/{name}/{path}"


def adamw_key(name: str, field_name: str) -> str:
    """The key of one AdamW moment of a parameter."""
    return f"adamw/{name}/{field_name}"


def main_key(name: str) -> str:
    """The key of a low-precision parameter's fp32 main copy."""
    return f"main/{name}"


def layout_sizes(layout: StateLayout) -> dict[str, tuple[int, ...]]:
    """Every logical tensor a state of `layout` can hold, key -> full size: each matrix's
    fields (SOAP's eigenbases included, which exist only after a step), each AdamW parameter's
    moments, and the fp32 main copy of each low-precision parameter."""
    sizes: dict[str, tuple[int, ...]] = {}
    for param in layout.params:
        for path, shape in layout.fields(param):
            key = matrix_key(param.name, path) if param.kind == MATRIX else adamw_key(param.name, path)
            sizes[key] = tuple(shape)
        if param.main_bytes:
            sizes[main_key(param.name)] = tuple(param.shape) if param.kind == MATRIX else (prod(param.shape),)
    return sizes


def state_leaves(node: Any, prefix: str = "") -> dict[str, Tensor | None]:
    """Every tensor (or None) of a nested state, by `/`-joined path (lists by index)."""
    items: Iterable[tuple[Any, Any]]
    if isinstance(node, dict):
        items = node.items()
    elif isinstance(node, list):
        items = enumerate(node)
    else:
        return {prefix: node}
    leaves: dict[str, Tensor | None] = {}
    for key, value in items:
        leaves.update(state_leaves(value, f"{prefix}/{key}" if prefix else str(key)))
    return leaves


def set_leaf(node: Any, path: str, value: Tensor) -> None:
    """Replace the leaf at `path` of a nested state."""
    *parents, last = path.split("/")
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    node[int(last) if isinstance(node, list) else last] = value


def adamw_runs(plan: RankPlan) -> list[AdamwRun]:
    """Every run of AdamW state this rank holds (its DP ranks' slices of its TP shards)."""
    entries = {e.index: e for e in plan.schedule.params}
    runs = []
    for piece in plan.adamw:
        entry = entries[piece.param]
        for full, local, length in full_runs(
            tuple(entry.shape),
            entry.tp_dim,
            plan.place.tp_size,
            plan.place.tp_rank,
            piece.src,
            piece.src + piece.length,
        ):
            runs.append(AdamwRun(piece.param, full, piece.offset + local - piece.src, length))
    return runs


def _logical(plan: RankPlan, param: int, tensor: Tensor, clone: bool) -> LogicalTensor:
    """A matrix's state tensor (or main copy, already canonical unless teamed) as held here:
    whole, or a team member's slice as its canonical chunks."""
    task = plan.tasks[param]
    if not task.team:
        return LogicalTensor(tuple(tensor.shape), [((0,) * tensor.dim(), tensor.clone() if clone else tensor)])
    chunks = canonical_chunks(task, task.team.index(plan.place.tp_rank), tensor)
    return LogicalTensor(task.shape, [(offsets, data.clone() if clone else data) for offsets, data in chunks])


def _add_run(
    out: dict[str, LogicalTensor], key: str, plan: RankPlan, run: AdamwRun, buffer: Tensor, clone: bool = False
) -> None:
    """Add an AdamW run of `buffer` (a state vector indexed like the AdamW moments) to the flat
    logical tensor `key` of its parameter."""
    data = buffer[run.local : run.local + run.length]
    entry = out.setdefault(key, LogicalTensor((prod(plan.shapes[run.param]),)))
    entry.chunks.append(((run.full,), data.clone() if clone else data))


def _main_runs(plan: RankPlan, state: OptimizerState) -> list[AdamwRun]:
    """The AdamW runs whose parameter has an fp32 main copy here."""
    if state.main.adamw is None:
        return []
    return [run for run in adamw_runs(plan) if plan.optimized(run.param) and plan.lowp(run.param)]


def _export_main(
    plan: RankPlan, state: OptimizerState, writers_only: bool, clone: bool, out: dict[str, LogicalTensor]
) -> None:
    """The main copies (none while stale: they equal the parameters, which a loader rebuilds
    them from)."""
    main = state.main
    if main.stale:
        return
    for param, tensor in main.matrices.items():
        if plan.writes_matrix(param) or not writers_only:
            teamed = bool(plan.tasks[param].team)
            canonical = tensor if teamed else to_canonical(tensor, plan.tasks[param])
            out[main_key(plan.names[param])] = _logical(plan, param, canonical, clone=teamed and clone)
    for run in _main_runs(plan, state):
        if writers_only and not plan.writes_adamw(run.param):
            continue
        assert main.adamw is not None
        _add_run(out, main_key(plan.names[run.param]), plan, run, main.adamw, clone)


def export_state(
    plan: RankPlan, state: OptimizerState, rule: MatrixRule, writers_only: bool, clone: bool
) -> dict[str, LogicalTensor]:
    """The logical state this rank holds (`writers_only`: one copy of every redundant replica,
    as a checkpoint saves it). Matrices not yet stepped export their initial state."""
    out: dict[str, LogicalTensor] = {}
    for param in plan.hosted:
        if writers_only and not plan.writes_matrix(param):
            continue
        states = state.matrix.get(param) or matrix_template(plan, rule, param)
        for path, tensor in state_leaves(states).items():
            if tensor is not None:
                out[matrix_key(plan.names[param], path)] = _logical(plan, param, tensor, clone)
    for run in adamw_runs(plan):
        if writers_only and not plan.writes_adamw(run.param):
            continue
        for name in ADAMW_MOMENTS:
            _add_run(out, adamw_key(plan.names[run.param], name), plan, run, state.adamw[name], clone)
    _export_main(plan, state, writers_only, clone, out)
    return out


def export_steps(plan: RankPlan, state: OptimizerState) -> dict[str, int]:
    """Per-parameter step counts that differ from the optimizer's (a parameter skipped on a
    step without gradients, or never optimized)."""
    return {name: count for name, count in zip(plan.names, state.param_steps) if count != state.step}


def _plan_main(
    plan: RankPlan, state: OptimizerState, available: Mapping[str, tuple[int, ...]], dest: Destination
) -> None:
    """Destinations for the main copies the saved state has; `main_complete` if it has all."""
    complete = True
    for param, current in state.main.matrices.items():
        key = main_key(plan.names[param])
        target = torch.empty_like(current)  # canonical order until installed (a team's slice: its own order)
        wanted = _logical(plan, param, target, clone=False)
        if available.get(key) != wanted.size:
            complete = False
            continue
        dest.main_matrices[param] = target
        dest.tensors[key] = wanted
    if state.main.adamw is not None:
        # Elements the saved state lacks (vocab padding rows only this layout has) start from
        # the parameters, as a rebuilt main copy would.
        dest.main_adamw = torch.empty_like(state.main.adamw)
        adamw_from_params(plan, dest.main_adamw)
        for run in _main_runs(plan, state):
            key = main_key(plan.names[run.param])
            if key not in available:
                complete = False
                continue
            _add_run(dest.tensors, key, plan, run, dest.main_adamw)
    dest.main_complete = complete


def plan_import(
    plan: RankPlan, state: OptimizerState, rule: MatrixRule, available: Mapping[str, tuple[int, ...]]
) -> Destination:
    """Fresh state buffers for everything this rank holds, and the logical chunks that fill
    them; ValueError naming what `available` (key -> full size) lacks."""
    tensors: dict[str, LogicalTensor] = {}
    matrix: dict[int, list[State]] = {}
    missing: list[str] = []
    for param in plan.hosted:
        states = matrix[param] = matrix_template(plan, rule, param)
        for path, tensor in state_leaves(states).items():
            key = matrix_key(plan.names[param], path)
            if tensor is None and key in available:  # e.g. SOAP's eigenbases, absent before step 1
                tensor = torch.empty(available[key], dtype=torch.float32, device=plan.device)
                set_leaf(states, path, tensor)
            if tensor is None:
                continue
            wanted = _logical(plan, param, tensor, clone=False)
            if available.get(key) != wanted.size:
                missing.append(
                    key
                    if key not in available
                    else f"{key} (shape {list(available[key])}, expected {list(wanted.size)})"
                )
                continue
            tensors[key] = wanted
    adamw = {name: torch.zeros_like(buffer) for name, buffer in state.adamw.items()}
    for run in adamw_runs(plan):
        for name in ADAMW_MOMENTS:
            key = adamw_key(plan.names[run.param], name)
            if key not in available:
                missing.append(key)
                continue
            _add_run(tensors, key, plan, run, adamw[name])
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"the saved state lacks {', '.join(sorted(set(missing))[:3])}{more}")
    dest = Destination(tensors, matrix, adamw)
    _plan_main(plan, state, available, dest)
    return dest


def _fill_run(key: str, offset: int, target: Tensor, sources: LogicalTensor) -> None:
    """Copy every source chunk overlapping [offset, offset + len) into `target`; ValueError
    unless the part the sources' tensor has is covered."""
    covered = torch.zeros(target.numel(), dtype=torch.bool, device=target.device)
    for (start,), data in sources.chunks:
        low, high = max(offset, start), min(offset + target.numel(), start + data.numel())
        if low < high:
            target[low - offset : high - offset].copy_(data[low - start : high - start])
            covered[low - offset : high - offset] = True
    needed = max(0, min(target.numel(), sources.size[0] - offset))
    if not bool(covered[:needed].all()):
        raise ValueError(
            f"the saved state of {key} does not cover the elements this rank needs (a state_dict of another rank?)"
        )


def _fill_box(key: str, offsets: Offsets, target: Tensor, sources: LogicalTensor, size: tuple[int, ...]) -> None:
    """Copy the parts of the source chunks (which do not overlap) inside the box `target`
    covers at `offsets`; ValueError unless they cover all of it (a matrix saved whole, or by
    a team in slices, both do)."""
    covered = 0
    for start, data in sources.chunks:
        box = [(max(o, s), min(o + n, s + m)) for o, n, s, m in zip(offsets, target.shape, start, data.shape)]
        if all(low < high for low, high in box):
            into, out_of = target, data
            for dim, (low, high) in enumerate(box):
                into = into.narrow(dim, low - offsets[dim], high - low)
                out_of = out_of.narrow(dim, low - start[dim], high - low)
            into.copy_(out_of)
            covered += into.numel()
    if covered < target.numel():
        raise ValueError(
            f"the saved state of {key} is not whole (expected chunks covering [{', '.join(map(str, size))}])"
        )


def fill_from(dest: Destination, tensors: Mapping[str, LogicalTensor]) -> None:
    """Fill `dest` from in-memory logical tensors (any chunking that covers what is needed)."""
    for key, wanted in dest.tensors.items():
        source = tensors[key]
        for offsets, target in wanted.chunks:
            if len(wanted.size) == 1:
                _fill_run(key, offsets[0], target, source)
            else:
                _fill_box(key, offsets, target, source, wanted.size)


def install(
    plan: RankPlan, state: OptimizerState, dest: Destination, step: int, param_steps: Mapping[str, int]
) -> None:
    """Make the imported state the optimizer's own (main copies missing from it are rebuilt
    from the parameters at the next step)."""
    state.matrix = dest.matrix
    state.adamw = dest.adamw
    state.step = step
    state.param_steps = [int(param_steps.get(name, step)) for name in plan.names]
    main = state.main
    main.stale = not dest.main_complete
    if dest.main_complete:
        for param, canonical in dest.main_matrices.items():
            if plan.tasks[param].team:
                main.matrices[param].copy_(canonical)
            else:
                from_canonical(canonical, plan.tasks[param], main.matrices[param])
        if dest.main_adamw is not None:
            main.adamw = dest.main_adamw


def ep_experts(plan: RankPlan) -> list[str]:
    """The experts the schedule places by expert parallelism (each rank's groups list only its
    own EP rank's, so group membership is compared without them)."""
    return [e.name for e in plan.schedule.params if e.ep_rank is not None]


def check_groups(
    plan: RankPlan, groups: list[dict[str, Any]], defaults: Hyperparameters, saved: Any, saved_experts: Any = ()
) -> list[dict[str, Any]] | None:
    """The saved groups' hyperparameters, checked against the optimizer's `groups` (the same
    parameters, group by group, leaving out the experts placed by expert parallelism on either
    side, `saved_experts` and this schedule's; and usable values); ValueError if they do not
    fit. None when the state has none."""
    if saved is None:
        return None
    if not isinstance(saved, list) or len(saved) != len(groups):
        found = len(saved) if isinstance(saved, list) else type(saved).__name__
        raise ValueError(f"the saved state has {found} param groups, this optimizer {len(groups)}")
    rule, placed = plan.schedule.request.optimizer.name, set(ep_experts(plan)) | set(saved_experts or ())

    def members(names: Any) -> list[str]:
        return [name for name in names if name not in placed]

    for position, (group, old) in enumerate(zip(groups, saved)):
        if members(old.get("param_names", [])) != members(group["param_names"]):
            raise ValueError(
                f"param_groups[{position}] holds other parameters in the saved state "
                "(the groups must be built the same way)"
            )
        try:
            group_hyperparameters({**group, **old}, defaults, rule)
        except ValueError as error:
            raise ValueError(f"saved param_groups[{position}]: {error}") from None
    return saved


def restore_groups(groups: list[dict[str, Any]], saved: list[dict[str, Any]] | None) -> None:
    """Set every group's hyperparameters (and scheduler keys such as initial_lr) as saved."""
    for group, old in zip(groups, saved or []):
        group.update({key: value for key, value in old.items() if key not in ("params", "param_names")})


UNSUPPORTED_STATE = (
    "canzona: CanzonaOptimizer's state is sharded by its schedule and kept in logical form; "
    "torch.distributed.checkpoint.state_dict cannot save or load it: use "
    "canzona.runtime.save_checkpoint(optimizer, path) / load_checkpoint(optimizer, path)"
)


class LogicalStateDict(dict[str, Any]):
    """`state_dict()`'s result: a plain dict, except that asking it for torch.optim's keys
    ("state", "param_groups" of tensors) explains where this state goes instead."""

    def __missing__(self, key: Any) -> Any:
        if key == "state":
            raise NotImplementedError(UNSUPPORTED_STATE)
        raise KeyError(key)
