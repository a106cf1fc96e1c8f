"""Whether optimizer state can move between two schedules of one model, and what moves where.

Pure logic over schedule files (imports only the file format): `canzona reshard-check` reports
it, and the runtime's checkpoints use the same rules to accept or reject a checkpoint.

**Logical optimizer state** (what a checkpoint holds; independent of DP, TP, α, buckets and
micro-groups). Every tensor is fp32 (4 bytes per element).

- Matrix parameter: per submatrix i (the rows of its row blocks, concatenated in order; the
  whole gathered matrix when it has none), under `<i>/<field>`:
  Muon `momentum` [r, c];
  Shampoo `momentum` [r, c] and, per block b (at most B×B, row-major block order),
  `blocks/<b>/L`, `blocks/<b>/L_root` [m, m] and `blocks/<b>/R`, `blocks/<b>/R_root` [n, n];
  SOAP `exp_avg`, `exp_avg_sq` [r, c], `L`, `QL` [r, r] when r ≤ max_precond_dim and `R`, `QR`
  [c, c] when c ≤ max_precond_dim (`QL`/`QR` exist from the first step on).
- AdamW parameter: `exp_avg` and `exp_avg_sq`, flattened row-major over the full shape.
- A bf16 / fp16 parameter also has its fp32 main copy, `main` (the full matrix, on the
  matrix's host; flattened for an AdamW parameter, beside its moments). It is not part of
  compatibility: a checkpoint without main copies (an fp32 model's) loads into a low-precision
  model, whose copies are then rebuilt from the parameters.

Bytes per parameter: Muon 4·r·c; Shampoo 4·(r·c + 2·Σ_blocks (m² + n²)); SOAP
4·(2·r·c + 2·r²·[r ≤ k] + 2·c²·[c ≤ k]) per submatrix; AdamW 8 per element; plus 4 per
element of the main copy of a low-precision parameter (only moved when both sides have it).

**Compatible** means: the same model (`request.model`: the same name, and the same sha256 for a
file, the same source for a preset), the same matrix
optimizer, the same parameter names, each updated by the same optimizer, with the same full
shape and submatrices, and state of the same shape (Shampoo block size; which SOAP sides are
preconditioned). One exception: an AdamW parameter whose full shape differs only in its first
dimension (Megatron pads the vocab to a multiple of 128·TP) is compatible; its common rows are
copied and the rows only the new layout has start at zero. A matrix without row blocks is
stored in gathered order (TP shards concatenated), the canonical order for every catalog model
(its fused fc1 carries row blocks whenever TP > 1); a parameter list records the fusion only
with `fused: N`, so `reshard_report` notes fc1 matrices without row blocks when TP changes.

**Ranks.** Global rank = dp_rank · tp + tp_rank. A matrix's state lives on its host (owner DP
rank, host TP rank); an AdamW element on the DP rank whose equal slice holds it, on the TP rank
holding its shard (every TP rank for a replicated parameter; TP rank 0 writes it). An element
"changes rank" when the NEW rank that needs it did not hold it under OLD.
"""

from __future__ import annotations

from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass, field
from math import prod
from typing import Any

from canzona.schedules.format import ParamEntry, Schedule, ScheduleError, registration_order
from canzona.schedules.fsdp import FsdpLayout, shard_numel
from canzona.schedules.geometry import chunk_bounds, tp_shard_shape
from canzona.schedules.limits import FSDP

MATRIX, ADAMW = "matrix", "adamw"
FP32 = 4
ADAMW_FIELDS = ("exp_avg", "exp_avg_sq")
MAX_LISTED = 4
Shape = tuple[int, ...]


def submatrix_shapes(shape: Shape, row_blocks: list[list[list[int]]] | None) -> tuple[tuple[int, int], ...]:
    """Shapes of the submatrices a matrix with `row_blocks` is updated as."""
    if not row_blocks:
        return ((shape[0], shape[1]),)
    return tuple((sum(stop - start for start, stop in block), shape[1]) for block in row_blocks)


def _spans(size: int, block: int) -> list[int]:
    return [min(start + block, size) - start for start in range(0, size, block)]


def state_fields(
    optimizer: str, rows: int, cols: int, block_size: int, max_precond_dim: int
) -> list[tuple[str, Shape]]:
    """The fp32 tensors of one rows×cols submatrix's state, as (field, shape)."""
    if optimizer == "muon":
        return [("momentum", (rows, cols))]
    if optimizer == "shampoo":
        fields: list[tuple[str, Shape]] = [("momentum", (rows, cols))]
        blocks = [(m, n) for m in _spans(rows, block_size) for n in _spans(cols, block_size)]
        for b, (m, n) in enumerate(blocks):
            fields += [
                (f"blocks/{b}/L", (m, m)),
                (f"blocks/{b}/R", (n, n)),
                (f"blocks/{b}/L_root", (m, m)),
                (f"blocks/{b}/R_root", (n, n)),
            ]
        return fields
    if optimizer == "soap":
        fields = [("exp_avg", (rows, cols)), ("exp_avg_sq", (rows, cols))]
        if rows <= max_precond_dim:
            fields += [("L", (rows, rows)), ("QL", (rows, rows))]
        if cols <= max_precond_dim:
            fields += [("R", (cols, cols)), ("QR", (cols, cols))]
        return fields
    raise ValueError(f"unknown matrix optimizer {optimizer!r}")


@dataclass(frozen=True)
class ParamState:
    """One parameter as its optimizer state sees it (`dtype`: the model's, so whether it has
    an fp32 main copy)."""

    name: str
    kind: str
    shape: Shape
    submatrices: tuple[tuple[int, int], ...] = ()
    dtype: str = "fp32"

    @property
    def main_bytes(self) -> int:
        """Bytes of the fp32 main copy (none for an fp32 parameter)."""
        return 0 if self.dtype == "fp32" else FP32 * prod(self.shape)


@dataclass(frozen=True)
class StateLayout:
    """Everything that decides the logical state's keys and shapes (JSON-serialisable)."""

    model: tuple[str, str, str | None]
    optimizer: str
    block_size: int
    max_precond_dim: int
    params: tuple[ParamState, ...]

    def fields(self, param: ParamState) -> list[tuple[str, Shape]]:
        """The logical tensors of `param`: (field, shape); matrix fields are `<i>/<field>`."""
        if param.kind != MATRIX:
            return [(name, (prod(param.shape),)) for name in ADAMW_FIELDS]
        return [
            (f"{i}/{name}", shape)
            for i, (rows, cols) in enumerate(param.submatrices)
            for name, shape in state_fields(self.optimizer, rows, cols, self.block_size, self.max_precond_dim)
        ]

    def state_nbytes(self, param: ParamState) -> int:
        """Bytes of `param`'s optimizer state, without the main copy."""
        return FP32 * sum(prod(shape) for _, shape in self.fields(param))

    def nbytes(self, param: ParamState) -> int:
        """Bytes of `param`'s logical state, main copy included."""
        return self.state_nbytes(param) + param.main_bytes

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready description (what a checkpoint records)."""
        return {
            "model": {"name": self.model[0], "source": self.model[1], "sha256": self.model[2]},
            "optimizer": self.optimizer,
            "block_size": self.block_size,
            "max_precond_dim": self.max_precond_dim,
            "params": [[p.name, p.kind, list(p.shape), [list(s) for s in p.submatrices], p.dtype] for p in self.params],
        }

    @classmethod
    def from_json(cls, data: Any) -> StateLayout:
        """Read `to_json()` output back; ValueError if it is not one."""
        try:
            model = data["model"]
            params = tuple(
                ParamState(
                    str(name),
                    str(kind),
                    tuple(int(n) for n in shape),
                    tuple((int(r), int(c)) for r, c in subs),
                    str(dtype[0]) if dtype else "fp32",
                )
                for name, kind, shape, subs, *dtype in data["params"]
            )
            return cls(
                (str(model["name"]), str(model["source"]), model["sha256"]),
                str(data["optimizer"]),
                int(data["block_size"]),
                int(data["max_precond_dim"]),
                params,
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"not a state layout ({type(error).__name__}: {error})") from error


def state_layout(
    schedule: Schedule, *, block_size: int | None = None, max_precond_dim: int | None = None
) -> StateLayout:
    """The state layout of `schedule`, with the optimizer settings that shape the state taken
    from the schedule unless given (the runtime passes the ones it actually uses)."""
    request = schedule.request
    params = tuple(
        ParamState(
            e.name,
            e.optimizer,
            tuple(e.shape),
            submatrix_shapes(tuple(e.shape), e.row_blocks) if e.optimizer == MATRIX else (),
            e.dtype,
        )
        for e in registration_order(schedule)
    )
    return StateLayout(
        (request.model.name, request.model.source, request.model.sha256),
        request.optimizer.name,
        block_size or request.optimizer.block_size,
        max_precond_dim or request.optimizer.max_precond_dim,
        params,
    )


def _listed(items: list[str]) -> str:
    more = f" (and {len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else ""
    return ", ".join(items[:MAX_LISTED]) + more


def _model_text(model: tuple[str, str, str | None]) -> str:
    name, source, sha = model
    details = [part for part in (source if source != name else "", f"sha256 {sha[:12]}" if sha else "") if part]
    return name + (f" ({', '.join(details)})" if details else "")


def padded_rows(old: ParamState, new: ParamState) -> bool:
    """Whether two AdamW shapes differ only in their first dimension (vocab padding)."""
    return (
        old.kind == new.kind == ADAMW
        and len(old.shape) == len(new.shape) >= 1
        and old.shape[1:] == new.shape[1:]
        and old.shape[0] != new.shape[0]
    )


def _param_problem(old: StateLayout, new: StateLayout, a: ParamState, b: ParamState) -> str | None:
    if a.kind != b.kind:
        return f"{a.name}: updated by {a.kind} before, by {b.kind} now"
    if a.shape != b.shape and not padded_rows(a, b):
        return f"{a.name}: full shape {list(a.shape)} before, {list(b.shape)} now"
    if a.kind != MATRIX:
        return None
    if a.submatrices != b.submatrices:
        return (
            f"{a.name}: updated as submatrices {[list(s) for s in a.submatrices]} before, "
            f"{[list(s) for s in b.submatrices]} now (split_qkv / split_fc1 differ)"
        )
    if old.fields(a) != new.fields(b):
        return (
            f"{a.name}: its {old.optimizer} state has a different shape (block_size {old.block_size} vs "
            f"{new.block_size}, max_precond_dim {old.max_precond_dim} vs {new.max_precond_dim})"
        )
    return None


def same_model(old: tuple[str, str, str | None], new: tuple[str, str, str | None]) -> bool:
    """Same name, and same file contents (sha256) or, for presets, the same source."""
    if old[2] or new[2]:
        return (old[0], old[2]) == (new[0], new[2])  # a file may be read from another path
    return old == new


def incompatibilities(old: StateLayout, new: StateLayout) -> list[str]:
    """Why state saved under `old` cannot be loaded under `new` (empty: it can)."""
    if not same_model(old.model, new.model):
        return [f"different models: {_model_text(old.model)} before, {_model_text(new.model)} now"]
    if old.optimizer != new.optimizer:
        return [f"different matrix optimizers: {old.optimizer} before, {new.optimizer} now"]
    problems = []
    before, after = {p.name: p for p in old.params}, {p.name: p for p in new.params}
    only_old = [name for name in before if name not in after]
    only_new = [name for name in after if name not in before]
    if only_old:
        problems.append(f"parameters no longer present: {_listed(only_old)}")
    if only_new:
        problems.append(f"parameters without saved state: {_listed(only_new)}")
    param_problems = [p for p in (_param_problem(old, new, before[n], after[n]) for n in before if n in after) if p]
    if param_problems:
        problems.append(_listed(param_problems) if len(param_problems) > 1 else param_problems[0])
    return problems


def padding_notes(old: StateLayout, new: StateLayout) -> list[str]:
    """One line per AdamW parameter whose padded rows differ (compatible, but not identical)."""
    before = {p.name: p for p in old.params}
    return [
        f"{p.name}: {before[p.name].shape[0]} rows before, {p.shape[0]} now (vocab padding): "
        "common rows are copied, new rows start at zero"
        for p in new.params
        if p.name in before and padded_rows(before[p.name], p)
    ]


def fusion_notes(old: Schedule, new: Schedule) -> list[str]:
    """When TP changes: fc1 matrices planned without row blocks (a parameter list without
    `fused: 2`) keep their state in gathered order, which then changes if they are fused."""
    if old.request.tp == new.request.tp:
        return []
    names = sorted(
        {
            e.name
            for s in (old, new)
            for e in s.params
            if s.request.tp > 1
            and e.optimizer == MATRIX
            and e.tp_dim == 0
            and not e.row_blocks
            and "linear_fc1" in e.name
        }
    )
    if not names:
        return []
    return [
        f"{_listed(names)}: no row blocks at TP > 1, so the state is kept in gathered order (TP shards "
        "concatenated); if each shard is fused [gate; up] (Megatron's fc1), that order changes with TP: "
        "declare it with `fused: 2` in the parameter list (or plan from a model config)"
    ]


def full_runs(
    shape: Shape, tp_dim: int | None, tp: int, tp_rank: int, start: int, stop: int
) -> list[tuple[int, int, int]]:
    """Where elements [start, stop) of TP rank `tp_rank`'s flattened shard (torch.chunk's
    rule, `geometry.tp_shard_shape`) lie in the flattened full tensor: (full offset, local
    offset, length) runs (one unless tp_dim > 0)."""
    if stop <= start:
        return []
    if tp_dim is None or tp == 1:
        return [(start, start, stop - start)]
    inner_full, tail = prod(shape[tp_dim:]), prod(shape[tp_dim + 1 :])
    first, last = chunk_bounds(shape[tp_dim], tp)[tp_rank]
    inner_local = (last - first) * tail
    runs, index = [], start
    while index < stop:
        outer, within = divmod(index, inner_local)
        length = min(stop - index, inner_local - within)
        runs.append((outer * inner_full + first * tail + within, index, length))
        index += length
    return runs


def _local_numel(entry: ParamEntry, tp: int, tp_rank: int) -> int:
    return prod(tp_shard_shape(entry.shape, entry.tp_dim, tp, tp_rank))


def adamw_runs(schedule: Schedule, entry: ParamEntry, writers_only: bool) -> list[tuple[int, int, int]]:
    """Runs of an AdamW parameter's logical state per global rank: (full start, full stop,
    rank), for the ranks that hold them (`writers_only`: TP rank 0 for a replicated one)."""
    tp = schedule.request.tp
    cuts = schedule.dp.adamw_buckets[entry.bucket].cuts
    tp_ranks = [0] if entry.tp_dim is None and writers_only else range(tp)
    runs = []
    for dp_rank in range(schedule.request.dp):
        for tp_rank in tp_ranks:
            stop_offset = entry.offset + _local_numel(entry, tp, tp_rank)
            low, high = max(entry.offset, cuts[dp_rank]), min(stop_offset, cuts[dp_rank + 1])
            for full, _, length in full_runs(
                tuple(entry.shape), entry.tp_dim, tp, tp_rank, low - entry.offset, high - entry.offset
            ):
                runs.append((full, full + length, dp_rank * tp + tp_rank))
    return sorted(runs)


def matrix_hosts(schedule: Schedule) -> dict[str, tuple[int, ...]]:
    """The global ranks holding each matrix's state: its host, or its team's members (equal
    slices, in team order)."""
    tp = schedule.request.tp
    out = {}
    for plan in schedule.tp.ranks:
        for group in plan.groups:
            teams = {team.param: team.hosts for team in group.teams}
            for name, host in zip(group.params, group.hosts):
                out[name] = tuple(plan.dp_rank * tp + member for member in teams.get(name, [host]))
    return out


def _matrix_moves(ledger: _Ledger, old: tuple[int, ...], new: tuple[int, ...], written: int, read: int) -> None:
    """A matrix's state from its OLD holders to its NEW ones: slice i to slice i when both
    teams are the same ranks, else every OLD slice spread evenly over the NEW holders."""
    for source in old:
        ledger.writes[source] += written // len(old)
    if old == new:
        for rank in old:
            ledger.move(rank, rank, read // len(old))
        return
    for source in old:
        for target in new:
            ledger.move(source, target, read // (len(old) * len(new)))


@dataclass
class ReshardReport:
    """Whether state moves from OLD to NEW, and the bytes per global rank if it does.

    `loads[r]`: bytes NEW rank r reads; `moved_in[r]`: of which a different OLD rank held;
    `writes[r]`: bytes OLD rank r saves; `moved_out[r]`: of which go to a different NEW rank;
    `flows`: (OLD rank, NEW rank, bytes) for every pair of different ranks."""

    compatible: bool
    problems: list[str]
    notes: list[str]
    state_bytes: int = 0
    loads: list[int] = field(default_factory=list)
    moved_in: list[int] = field(default_factory=list)
    writes: list[int] = field(default_factory=list)
    moved_out: list[int] = field(default_factory=list)
    flows: list[tuple[int, int, int]] = field(default_factory=list)


class _Ledger:
    def __init__(self, old_world: int, new_world: int) -> None:
        self.loads, self.moved_in = [0] * new_world, [0] * new_world
        self.writes, self.moved_out = [0] * old_world, [0] * old_world
        self.flows: dict[tuple[int, int], int] = defaultdict(int)

    def move(self, source: int, target: int, nbytes: int) -> None:
        """`nbytes` that NEW rank `target` reads, held by OLD rank `source`."""
        self.loads[target] += nbytes
        if source != target:
            self.moved_in[target] += nbytes
            self.moved_out[source] += nbytes
            self.flows[(source, target)] += nbytes


def _check_structure(schedule: Schedule, which: str) -> None:
    """ScheduleError unless every matrix has a host and every AdamW bucket has D + 1 cuts."""
    hosts, dp = matrix_hosts(schedule), schedule.request.dp
    unhosted = [e.name for e in schedule.params if e.optimizer == MATRIX and e.name not in hosts and e.ep_rank is None]
    if unhosted:
        raise ScheduleError(f"{which} schedule: no micro-group hosts {_listed(unhosted)}")
    buckets = schedule.dp.adamw_buckets
    for e in schedule.params:
        if e.optimizer != MATRIX and not (0 <= e.bucket < len(buckets) and len(buckets[e.bucket].cuts) == dp + 1):
            raise ScheduleError(
                f"{which} schedule: {e.name} is in AdamW bucket {e.bucket}, which does not exist or lacks {dp + 1} cuts"
            )


def _main_per_element(a: ParamEntry, b: ParamEntry) -> tuple[int, int]:
    """Bytes per element of the main copy (written under OLD, read under NEW)."""
    written = 0 if a.dtype == "fp32" else FP32
    return written, written if b.dtype != "fp32" else 0


def _adamw_moves(old: Schedule, new: Schedule, a: ParamEntry, b: ParamEntry, ledger: _Ledger) -> None:
    """A replicated element a NEW rank already held under OLD does not move; otherwise it comes
    from the OLD rank that wrote it (the lowest of its holders: TP rank 0)."""
    written, read = _main_per_element(a, b)
    holders: dict[tuple[int, int], list[int]] = defaultdict(list)
    for start, stop, rank in adamw_runs(old, a, writers_only=False):
        holders[(start, stop)].append(rank)
    spans = sorted(holders)
    for span in spans:
        ledger.writes[min(holders[span])] += (8 + written) * (span[1] - span[0])
    starts = [start for start, _ in spans]
    for start, stop, target in adamw_runs(new, b, writers_only=False):
        index = max(0, bisect_right(starts, start) - 1)
        while index < len(spans) and spans[index][0] < stop:
            low, high = max(start, spans[index][0]), min(stop, spans[index][1])
            ranks = holders[spans[index]]
            if low < high:
                ledger.move(target if target in ranks else min(ranks), target, (8 + read) * (high - low))
            index += 1


def expert_notes(old: Schedule, new: Schedule) -> list[str]:
    """Under expert parallelism on either side: how many expert matrices change EP rank (their
    whole state moves to the new holder's DP ranks; keys are the experts' global names)."""
    a, b = old.request.ep, new.request.ep
    if a == 1 and b == 1:
        return []
    old_rank = {e.name: e.ep_rank for e in old.params if e.optimizer == MATRIX}
    experts = [e for e in new.params if e.ep_rank is not None or old_rank.get(e.name) is not None]
    moved = sum(old_rank.get(e.name) != e.ep_rank for e in experts)
    return [f"experts: EP {a} -> EP {b}, {moved} of {len(experts)} expert matrices change EP rank"]


def reshard_report(old: Schedule, new: Schedule) -> ReshardReport:
    """Whether optimizer state saved under `old` loads under `new` (CanzonaOptimizer's
    placement), and the bytes each rank writes, reads and exchanges. ScheduleError if a
    schedule is inconsistent."""
    if FSDP in (old.request.sharding, new.request.sharding):
        return fsdp_report(old, new)
    _check_structure(old, "OLD")
    _check_structure(new, "NEW")
    old_layout, new_layout = state_layout(old), state_layout(new)
    problems = incompatibilities(old_layout, new_layout)
    if problems:
        return ReshardReport(False, problems, [])
    ledger = _Ledger(old.request.dp * old.request.tp, new.request.dp * new.request.tp)
    old_hosts, new_hosts = matrix_hosts(old), matrix_hosts(new)
    entries = {e.name: e for e in old.params}
    params = {p.name: p for p in new_layout.params}
    for b in new.params:
        a = entries[b.name]
        if b.optimizer == MATRIX:
            state, (written, read) = new_layout.state_nbytes(params[b.name]), _main_per_element(a, b)
            _matrix_moves(
                ledger,
                old_hosts[a.name],
                new_hosts[b.name],
                state + written * prod(a.shape),
                state + read * prod(b.shape),
            )
        else:
            _adamw_moves(old, new, a, b, ledger)
    return ReshardReport(
        True,
        [],
        padding_notes(old_layout, new_layout) + fusion_notes(old, new) + expert_notes(old, new),
        sum(old_layout.nbytes(p) for p in old_layout.params),
        ledger.loads,
        ledger.moved_in,
        ledger.writes,
        ledger.moved_out,
        sorted((s, t, n) for (s, t), n in ledger.flows.items()),
    )


def _plan_of(schedule: Schedule) -> str:
    """The schedule without what does not change the execution (digest, canzona version)."""
    return schedule.model_dump_json(exclude={"digest": True, "request": {"canzona_version"}})


def fsdp_report(old: Schedule, new: Schedule) -> ReshardReport:
    """FsdpOptimizer's checkpoints: every device loads its own state under the very same
    schedule; state does not move between FSDP and replicated schedules, nor between two FSDP
    schedules (no resharding of FSDP optimizer state yet)."""
    modes = (old.request.sharding, new.request.sharding)
    if modes[0] != modes[1]:
        return ReshardReport(
            False,
            [
                f"sharding differs: OLD {modes[0]}, NEW {modes[1]}; optimizer state does not move "
                "between CanzonaOptimizer (replicated) and FsdpOptimizer (FSDP2) checkpoints"
            ],
            [],
        )
    if _plan_of(old) != _plan_of(new):
        return ReshardReport(
            False,
            [
                "both schedules are FSDP but differ; FsdpOptimizer loads optimizer state only under "
                "the schedule it was saved under, on the same devices (no FSDP resharding yet)"
            ],
            [],
        )
    req, layout = new.request, state_layout(new)
    fsdp = FsdpLayout.of(req.tp, req.dp, req.dp_replicate)
    params = {p.name: p for p in layout.params}
    hosts = {n: h for g in new.tp.ranks[0].groups for n, h in zip(g.params, g.hosts)}
    per_fragment = [0] * fsdp.hosts
    for e in new.params:
        if e.optimizer == MATRIX:
            per_fragment[hosts[e.name]] += layout.nbytes(params[e.name])
        else:
            main = FP32 if e.dtype != "fp32" else 0
            for fragment in range(fsdp.hosts):
                per_fragment[fragment] += (2 * FP32 + main) * shard_numel(e.shape, e.tp_dim, fsdp, fragment)
    ledger = _Ledger(req.dp * req.tp, req.dp * req.tp)
    for rank in range(req.dp * req.tp):
        ledger.writes[rank] = per_fragment[fsdp.fragment_of(rank)]
        ledger.move(rank, rank, per_fragment[fsdp.fragment_of(rank)])
    return ReshardReport(
        True,
        [],
        ["FSDP: every device loads the state it saved (same schedule, same devices)"],
        sum(ledger.writes),
        ledger.loads,
        ledger.moved_in,
        ledger.writes,
        ledger.moved_out,
        [],
    )
