"""Where `canzona plan` writes a schedule, and what it refuses to replace.

The default file name encodes every option that changes the plan, those at their defaults left
out (`plan_stem`), so two different plans never share a default name and today's default names
stay what they were. Inside a canzona checkout (`in_checkout`) the file joins the schedule
library as `schedules/<model>/<name>.yaml`; anywhere else it is `./<model>-<name>.yaml`, a plain
file name that `canzona show` reads as given. An existing file is replaced only by the same
plan (`replacement_problem`), unless `--force`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from canzona.schedules.geometry import DEFAULT_BUCKET_SIZE
from canzona.schedules.limits import FSDP, PROFILE_PREFIX
from canzona.schedules.text import printable

if TYPE_CHECKING:
    from canzona.planner.request import PlanRequest
    from canzona.schedules.format import Request

DEFAULT_DEVICE = "h100"  # what `--alpha auto` and `--bucket-size auto` simulate on unless told
MIB = 1 << 20
UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
PROJECT_NAME = re.compile(r'^name\s*=\s*"canzona"\s*$', re.MULTILINE)
SETTING_LABELS = {
    "ns_steps": "ns",
    "block_size": "block",
    "precondition_frequency": "every",
    "max_precond_dim": "maxdim",
    "ns_coefficients": "ns-",
    "ns_method": "ns-",
    "gram_restart": "restart",
    "ns_dtype": "ns-",
}


def file_part(text: str) -> str:
    """`text` made safe as part of a file name: runs of anything but letters, digits, `.`, `_`
    and `-` become `_`, and no leading dot (no hidden file, no `..`)."""
    return UNSAFE.sub("_", text).lstrip(".") or "_"


def in_checkout(folder: Path | None = None) -> bool:
    """Whether `folder` (default: the working directory) is the root of a canzona checkout: its
    `pyproject.toml` names the project canzona and it holds the schedule library `schedules/`.
    There, `plan` adds to the library; anywhere else it writes next to the user."""
    root = Path.cwd() if folder is None else folder
    try:
        text = (root / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return PROJECT_NAME.search(text) is not None and (root / "schedules").is_dir()


def default_output(model_name: str, request: PlanRequest, own_names: str, checkout: bool) -> Path:
    """`schedules/<model>/<stem>.yaml` in a canzona checkout, else `<model>-<stem>.yaml` in the
    working directory (`plan_stem`; `own_names`: the naming convention the model source uses
    unless `--names` says otherwise)."""
    model, stem = file_part(model_name), plan_stem(request, own_names)
    return Path("schedules") / model / f"{stem}.yaml" if checkout else Path(f"{model}-{stem}.yaml")


def plan_stem(request: PlanRequest, own_names: str) -> str:
    """`<optimizer>-tp<T>-dp<D>` and one part per option that changes the plan and is not at its
    default: `-ep<E>`, `-fsdp` / `-hsdp<R>`, `-alpha<A>` / `-alphaauto`, `-<cost>`, then the
    bucket size, the searches' device and training, the optimizer's settings, the model's
    options, the TP scheduler, cooperative hosting, the solver and the parameter order."""
    parts = [
        f"{request.optimizer.name}-tp{request.tp}-dp{request.dp}",
        *_layout_parts(request),
        *_search_parts(request),
        *_setting_parts(request),
        *_model_parts(request, own_names),
        *_scheduler_parts(request),
    ]
    return "-".join(part for part in parts if part)


def _number(value: float) -> str:
    """A number as short as `:g` spells it, in full where that would round it."""
    text = f"{value:g}"
    return text if float(text) == value else repr(value)


def _source_label(source: str) -> str:
    """A cost model or device for a file name: `profile:dir/gpu.yaml` -> `profile-gpu`."""
    if source.startswith(PROFILE_PREFIX):
        return "profile-" + file_part(Path(source.removeprefix(PROFILE_PREFIX)).stem)
    return file_part(source)


def _layout_parts(request: PlanRequest) -> Iterator[str]:
    yield f"ep{request.ep}" if request.ep > 1 else ""
    if request.sharding == FSDP:
        yield "fsdp" if request.dp_replicate == 1 else f"hsdp{request.dp_replicate}"


def _search_parts(request: PlanRequest) -> Iterator[str]:
    from canzona.planner.request import TrainingSetup

    yield (
        "alphaauto"
        if request.alpha_device is not None
        else ("" if request.alpha == 1.0 else f"alpha{_number(request.alpha)}")
    )
    yield "" if request.cost == "flops" else _source_label(request.cost)
    yield (
        "bucketauto"
        if request.bucket_device is not None
        else ("" if request.bucket_size == DEFAULT_BUCKET_SIZE else f"bucket{request.bucket_size}")
    )
    device = request.alpha_device or request.bucket_device
    yield "" if device in (None, DEFAULT_DEVICE) else f"on-{_source_label(device)}"
    if request.searching:
        training, default = request.training or TrainingSetup(), TrainingSetup()
        yield "" if training.global_batch == default.global_batch else f"gb{training.global_batch}"
        yield "" if training.seq_len == default.seq_len else f"seq{training.seq_len}"
        yield "" if training.micro_batches is None else f"mb{training.micro_batches}"


def _setting_parts(request: PlanRequest) -> Iterator[str]:
    from canzona.planner.partition.costs import OptimizerConfig

    default = OptimizerConfig(request.optimizer.name)
    for key, label in SETTING_LABELS.items():
        value = getattr(request.optimizer, key)
        yield "" if value == getattr(default, key) else f"{label}{value}"


def _model_parts(request: PlanRequest, own_names: str) -> Iterator[str]:
    from canzona.planner.spec import ModelOptions

    options, default = request.options, ModelOptions()
    yield "" if options.split_qkv == default.split_qkv else f"qkv-{options.split_qkv}"
    yield "split-fc1" if options.split_fc1 else ""
    yield "" if options.router_optimizer == default.router_optimizer else f"router-{options.router_optimizer}"
    yield "" if options.names == own_names else file_part(options.names)
    yield "sp" if options.sequence_parallel else ""
    yield "" if options.dtype is None else file_part(options.dtype)


def _scheduler_parts(request: PlanRequest) -> Iterator[str]:
    from canzona.planner.request import PlanRequest

    default = PlanRequest(request.model, request.tp, request.dp, solver=request.solver, sharding=request.sharding)
    yield "" if request.tp_mode == default.tp_mode else f"tp-{request.tp_mode}"
    if request.group_bytes != default.group_bytes:
        whole = request.group_bytes % MIB == 0
        yield f"group{request.group_bytes // MIB}mb" if whole else f"group{request.group_bytes}b"
    yield "" if request.coop == default.coop else f"coop-{request.coop}"
    yield "" if request.tp_update == default.tp_update else f"tp-update-{request.tp_update}"
    yield "" if request.solver == "greedy" else file_part(request.solver)
    yield "" if request.time_limit == default.time_limit else f"limit{_number(request.time_limit)}s"
    yield "" if request.seed == default.seed else f"seed{request.seed}"
    yield "" if request.order == default.order else f"order-{request.order}"


# --------------------------------------------------------------------------------------------
# Replacing an existing file


def replacement_problem(path: Path, planned: Request) -> str | None:
    """Why the schedule `planned` must not silently replace the file at `path` (None: there is no
    file, or it records the same request, so it holds this very plan). The message names `-o`
    and `--force`."""
    from canzona.schedules.errors import ScheduleError
    from canzona.schedules.format import read_request, schedule_text

    if not path.exists():
        return None
    remedy = "give -o FILE to write elsewhere, or --force to replace it"
    try:
        recorded = read_request(schedule_text(path), str(path))
    except ScheduleError:
        return f"refusing to replace {str(path)!r}: it is not a schedule this canzona can read; {remedy}"
    difference = request_difference(recorded, planned)
    if difference is None:
        return None
    return f"refusing to replace {str(path)!r}: it holds another plan ({printable(difference)}); {remedy}"


def request_difference(recorded: Request, planned: Request) -> str | None:
    """The first setting in which two requests ask for different plans, as `KEY OLD there, NEW
    now` (None: the same plan). Not compared: the canzona version and the model's sha256 (a
    model file edited since is planned again in place), and α and the bucket size where the
    new request searches them (the search decides; its device and training are compared)."""
    old, new = _flat(recorded), _flat(planned)
    if planned.alpha_device is not None:
        old.pop("alpha", None), new.pop("alpha", None)
    if planned.bucket_device is not None:
        old.pop("bucket_size", None), new.pop("bucket_size", None)
    for key in sorted(set(old) | set(new)):
        if old.get(key) != new.get(key):
            return f"{key} {_shown(old.get(key))} there, {_shown(new.get(key))} now"
    return None


def _shown(value: Any) -> str:
    return "unset" if value is None else str(value)


def _flat(request: Request) -> dict[str, Any]:
    """A request as `key: value`, nested sections as `section.key`."""
    data = request.model_dump(mode="json", exclude={"canzona_version": True, "model": {"sha256"}})
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update({f"{key}.{inner}": item for inner, item in value.items()})
        else:
            flat[key] = value
    return flat
