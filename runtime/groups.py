"""Parameter groups: what a training script passes, checked against the schedule, and the
hyperparameters each group gives a step.

A script passes `model.named_parameters()` (one group) or a list of dicts whose `"params"` are
`(name, tensor)` pairs, as for any `torch.optim` optimizer. The names match the schedule.
`param_groups` are exactly those groups, one per dict: a group may hold matrices (Muon /
Shampoo / SOAP) and AdamW parameters, and carries the keys of both:

- `lr`, `weight_decay` and the rule's knobs apply to its matrices;
- `adamw_lr`, `adamw_weight_decay`, `adamw_betas`, `adamw_eps` apply to its AdamW parameters.

What a group leaves out comes from the optimizer's keyword arguments. A key the user sets that
would apply to no parameter of its group (e.g. `weight_decay` in a group of norms only: say
`adamw_weight_decay`) is an error.

LR schedulers drive `lr`, and the AdamW parameters follow by the same factor: a step uses
`adamw_lr · lr / initial_lr` for them, where `initial_lr` is the group's `lr` at construction
(the base every `torch.optim.lr_scheduler` starts from). So `LambdaLR(optimizer, [f, g])` takes
one function per group the script passed, and a warm-up scales both rules alike.

Parameters with `requires_grad=False` are not optimized; schedule parameters that are not
passed at all are treated the same way (pass only the trainable ones if you like).

Nothing here raises on bad input: every problem is returned as a line, so the optimizer can
make every rank raise the same error before any collective.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from torch import Tensor

from canzona.runtime.binding import local, placement_problems
from canzona.runtime.integrations import titan
from canzona.runtime.rules.optimizers import Hyperparameters
from canzona.runtime.schedule import tensor_problems
from canzona.schedules.format import ParamEntry
from canzona.schedules.limits import ADAMW, MATRIX

MATRIX_KNOBS: dict[str, tuple[str, ...]] = {
    "muon": (
        "momentum",
        "nesterov",
        "ns_steps",
        "ns_coefficients",
        "ns_dtype",
        "ns_method",
        "gram_restart",
        "update_scale",
        "update_scale_factor",
    ),
    "shampoo": ("momentum", "nesterov", "precondition_frequency", "shampoo_beta2", "graft_rms", "matrix_eps"),
    "soap": ("soap_betas", "soap_shampoo_beta", "soap_eps", "precondition_frequency"),
}
ADAMW_KEYS = ("adamw_lr", "adamw_weight_decay", "adamw_betas", "adamw_eps")  # a group's keys, Hyperparameters' fields
TUPLE_KNOBS = ("ns_coefficients", "soap_betas", "adamw_betas")
INT_KNOBS = ("ns_steps", "precondition_frequency", "gram_restart")
MAX_LISTED = 3


@dataclass
class ResolvedGroups:
    """The groups to hand to `torch.optim.Optimizer` (params as (name, tensor) pairs, plus every
    hyperparameter and `initial_lr`), the schedule parameters left out, and the problems."""

    groups: list[dict[str, Any]] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def matrix_keys(rule: str) -> tuple[str, ...]:
    """The hyperparameters of a matrix group under `rule` (muon, shampoo, soap)."""
    return ("lr", "weight_decay", *MATRIX_KNOBS[rule])


def listed(items: list[str], separator: str = ", ") -> str:
    """The first few of `items`, and how many more there are."""
    more = f" (and {len(items) - MAX_LISTED} more)" if len(items) > MAX_LISTED else ""
    return separator.join(items[:MAX_LISTED]) + more


def _user_groups(params: list[Any]) -> tuple[list[dict[str, Any]], list[str]]:
    if not params:
        return [], ["got an empty parameter list"]
    if not isinstance(params[0], dict):
        return [{"params": params}], []
    bad = [str(i) for i, group in enumerate(params) if not isinstance(group, dict) or "params" not in group]
    if bad:
        return [], [f"param group(s) {', '.join(bad)}: expected dicts with a 'params' list"]
    return [dict(group) for group in params], []


def _pairs(index: int, group: dict[str, Any], problems: list[str]) -> list[tuple[str, Tensor]]:
    items = group["params"]
    items = list(items) if not isinstance(items, (Tensor, dict, str)) else [items]
    pairs = [
        item
        for item in items
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], Tensor)
    ]
    if len(pairs) != len(items):
        problems.append(
            f"param group {index}: parameters must be (name, tensor) pairs named as in the schedule "
            "(pass model.named_parameters(), or groups of such pairs)"
        )
    return pairs


def _check_names(
    index: int,
    pairs: list[tuple[str, Tensor]],
    entries: Mapping[str, ParamEntry],
    seen: dict[Any, int],
    problems: list[str],
) -> None:
    """Unknown names, parameters listed twice (by name or tensor; `seen` maps both to the
    group), and an order the schedule does not have."""
    unknown = [name for name, _ in pairs if name not in entries]
    if unknown:
        problems.append(f"param group {index}: not in the schedule: {listed(unknown)}")
    for name, tensor in pairs:
        where = seen.get(id(tensor), seen.get(name))
        if where is not None:
            groups = f"param groups {where} and {index}" if where != index else f"param group {index} twice"
            problems.append(f"{name} is in {groups}")
        seen[id(tensor)] = seen[name] = index
    known = [(name, tensor) for name, tensor in pairs if name in entries]
    for (first, _), (second, _) in zip(known, known[1:]):
        if entries[first].index > entries[second].index:
            problems.append(
                f"param group {index}: {second!r} follows {first!r}, but the schedule registers them "
                "the other way round (another model?)"
            )
            break


def _value(key: str, value: Any) -> Any:
    """A group value in the form the rules take (floats, ints, tuples); ValueError if it is none."""
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{key} must be a number, got a tensor of shape {list(value.shape)}")
        value = value.item()
    if key == "ns_coefficients":
        return _coefficients(value)
    if key in TUPLE_KNOBS:
        return tuple(float(v) for v in value) if isinstance(value, (tuple, list)) else value
    if (
        key in INT_KNOBS
        or key in ("nesterov", "update_scale", "ns_dtype", "ns_method")
        or (key == "update_scale_factor" and value is None)
    ):
        return value
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _coefficients(value: Any) -> Any:
    """A coefficient schedule as given (a name, a triple, triples) in tuple form, numbers as floats."""
    if isinstance(value, (tuple, list)):
        return tuple(_coefficients(v) for v in value)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def _ratio(group: Mapping[str, Any]) -> float:
    """How far a scheduler (or the script) has moved the group's `lr` from `initial_lr`."""
    initial = _value("initial_lr", group.get("initial_lr", group["lr"]))
    return _value("lr", group["lr"]) / initial if isinstance(initial, float) and initial > 0 else 1.0


def group_hyperparameters(group: Mapping[str, Any], defaults: Hyperparameters, rule: str) -> Hyperparameters:
    """The hyperparameters one group gives a step (its values over the resolved `defaults`;
    the AdamW learning rate scaled as `lr` moved from `initial_lr`); ValueError naming the
    first bad value."""
    try:
        changes = {key: _value(key, group[key]) for key in (*matrix_keys(rule), *ADAMW_KEYS)}
    except KeyError as error:
        raise ValueError(f"it lacks {error.args[0]!r}") from None
    except (TypeError, ValueError) as error:
        raise ValueError(str(error)) from None
    hp = replace(defaults, **changes)
    hp.check()
    try:
        ratio = _ratio(group)
    except (TypeError, ValueError) as error:
        raise ValueError(f"initial_lr: {error}") from None
    return replace(hp, adamw_lr=hp.adamw_lr * ratio)


def _check_group(
    index: int,
    group: dict[str, Any],
    pairs: list[tuple[str, Tensor]],
    entries: Mapping[str, ParamEntry],
    rule: str,
    problems: list[str],
) -> None:
    """Unknown keys, and keys that would apply to no parameter of the group."""
    has_matrix = any(entries[name].optimizer == MATRIX for name, _ in pairs)
    has_adamw = any(entries[name].optimizer == ADAMW for name, _ in pairs)
    allowed = set(matrix_keys(rule)) | set(ADAMW_KEYS) | {"params", "initial_lr"}
    unknown = sorted(set(group) - allowed)
    if unknown:
        problems.append(
            f"param group {index}: unknown key(s) {', '.join(map(repr, unknown))}; a group takes "
            f"{', '.join(sorted(allowed - {'params'}))}"
        )
    unused = [
        key for key in group if (key in matrix_keys(rule) and not has_matrix) or (key in ADAMW_KEYS and not has_adamw)
    ]
    if unused and pairs:
        kind = "matrix" if not has_matrix else "AdamW"
        problems.append(
            f"param group {index}: {', '.join(map(repr, unused))} would apply to its {kind} parameters, "
            f"but it has none"
            + ("; AdamW parameters take adamw_lr, adamw_weight_decay, adamw_betas, adamw_eps" if not has_matrix else "")
        )


def _group(
    group: dict[str, Any], pairs: list[tuple[str, Tensor]], rule: str, defaults: Hyperparameters
) -> dict[str, Any]:
    """One optimizer group: its parameters and every key, those left out from `defaults`."""
    values = {key: group.get(key, getattr(defaults, key)) for key in (*matrix_keys(rule), *ADAMW_KEYS)}
    return {"params": pairs, **values, "initial_lr": group.get("initial_lr", values["lr"])}


def _model_problems(
    pairs: list[tuple[str, Tensor]],
    entries: Mapping[str, ParamEntry],
    tp: int,
    tp_rank: int,
    grad_attr: str,
    fsdp: bool,
) -> list[str]:
    problems = []
    for name, tensor in pairs:
        if name not in entries:
            continue
        if fsdp:  # FSDP2 shards over DP too: global shapes here, placements in fsdp_checks
            problems += tensor_problems(entries[name], tensor, tp, tp_rank)
        else:
            entry = entries[name]
            problems += placement_problems(entry, tensor, tp) + tensor_problems(entry, local(tensor), tp, tp_rank)
            problems += titan.spmd_problems(name, tensor, entry.tp_dim, entry.grad_reduce is not None, tp)
    devices = sorted({str(tensor.device) for _, tensor in pairs})
    if len(devices) > 1:
        problems.append(f"parameters are on several devices ({', '.join(devices)}); one optimizer serves one device")
    leafless = [name for name, tensor in pairs if tensor.requires_grad and not tensor.is_leaf]
    if leafless:
        problems.append(f"not leaf tensors (cannot be optimized): {listed(leafless)}")
    if grad_attr != "grad":
        lacking = [name for name, tensor in pairs if tensor.requires_grad and not hasattr(tensor, grad_attr)]
        if lacking:
            problems.append(f"grad_attr {grad_attr!r}: no such attribute on {listed(lacking)}")
    return problems


def resolve_param_groups(
    params: list[Any],
    entries: Mapping[str, ParamEntry],
    tp: int,
    rule: str,
    defaults: Hyperparameters,
    grad_attr: str = "grad",
    fsdp: bool = False,
    tp_rank: int = 0,
) -> ResolvedGroups:
    """Check what a script passed against the schedule (`entries` by name, TP size `tp`, this
    rank's TP rank `tp_rank`) and
    build one group per user group; every problem is returned, nothing raises. `fsdp`: the
    parameters are FSDP2-sharded, so their global shapes are checked (their placements are
    the FSDP optimizer's to check)."""
    result = ResolvedGroups()
    user_groups, result.problems = _user_groups(params)
    seen: dict[Any, int] = {}
    every: list[tuple[str, Tensor]] = []
    for index, group in enumerate(user_groups):
        pairs = _pairs(index, group, result.problems)
        _check_names(index, pairs, entries, seen, result.problems)
        every += pairs
        trainable = [(name, tensor) for name, tensor in pairs if name in entries and tensor.requires_grad]
        _check_group(index, group, trainable, entries, rule, result.problems)
        result.groups.append(_group(group, trainable, rule, defaults))
    result.problems += _model_problems(every, entries, tp, tp_rank, grad_attr, fsdp)
    managed = {name for group in result.groups for name, _ in group["params"]}
    result.frozen = [name for name in sorted(entries, key=lambda n: entries[n].index) if name not in managed]
    if user_groups and not managed and not result.problems:
        result.problems.append("no parameter to optimize (every one has requires_grad=False)")
    for position, group in enumerate(result.groups):
        try:
            group_hyperparameters(group, defaults, rule)
        except ValueError as error:
            result.problems.append(f"param_groups[{position}]: {error}")
    return result
