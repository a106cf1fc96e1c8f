"""What the commands share: reading a schedule by path or library name, the `--device`
vocabulary, refusing options that would have no effect, and writing output files."""

from __future__ import annotations

import difflib
import errno
import os
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from canzona.planner.spec import PlanError
from canzona.schedules.errors import ScheduleError
from canzona.schedules.files import OutputError, write_atomic
from canzona.schedules.library import library_names, resolve_schedule
from canzona.schedules.limits import PROFILE_PREFIX, SETTING_USERS

try:  # typer >= 0.20 vendors click
    from typer._click.core import ParameterSource
    from typer._click.globals import get_current_context
except ImportError:  # pragma: no cover - older typer depends on click
    # click's own ParameterSource and get_current_context, which mypy, reading the vendored
    # copy installed here, takes for other ones
    from click.core import ParameterSource  # type: ignore[assignment]
    from click.globals import get_current_context  # type: ignore[no-redef]

if TYPE_CHECKING:
    from canzona.schedules.format import Schedule


class Dtype(str, Enum):
    """--dtype: every parameter's dtype, over the model source's own."""

    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


SCHEDULE_HELP = "Schedule file, or a library name such as qwen3-8b/muon-tp2-dp4."
DEVICE_HELP = "Hardware model: h100, h200, a100, cpu, or profile:FILE (a `canzona calibrate` profile)."


# --------------------------------------------------------------------------------------------
# Schedules: a path or a library name


def schedule_path(ref: str | os.PathLike[str]) -> Path:
    """The file a schedule argument names: a path that exists, else the shipped library schedule
    of that name. ScheduleError (one line, with close library names) when it is neither."""
    path = resolve_schedule(ref)
    if path.exists() or os.path.islink(path):
        return path
    raise ScheduleError(
        f"cannot read schedule {str(ref)!r}: no such file, and no library schedule of that name"
        + library_hint(str(ref))
    )


def library_hint(ref: str) -> str:
    """` (did you mean: a, b?)` with the library names closest to `ref`, or nothing."""
    close = difflib.get_close_matches(ref.removesuffix(".yaml"), library_names(), n=3)
    return f" (did you mean: {', '.join(close)}?)" if close else ""


def load_schedule(ref: str | os.PathLike[str]) -> Schedule:
    """Read and validate the schedule a path or library name names."""
    from canzona.schedules.format import read_schedule  # here: commands that read none start fast

    return read_schedule(schedule_path(ref))


# --------------------------------------------------------------------------------------------
# --device: one vocabulary for plan, simulate and render


def device_option(text: str, label: str = "--device") -> str:
    """A built-in hardware model (lower-cased) or `profile:FILE`, as `--device` takes it
    everywhere; PlanError for anything else, naming the spelling a profile needs."""
    from canzona.planner.predict.hardware import DEVICE_NAMES

    key = text.strip().lower()
    if key in DEVICE_NAMES:
        return key
    if text.startswith(PROFILE_PREFIX):
        if not text.removeprefix(PROFILE_PREFIX):
            raise PlanError(f"{label} profile: needs a file, as in profile:my-gpu.yaml")
        return text
    hint = f"; a profile is given as profile:{text}" if Path(text).suffix.lower() in (".yaml", ".yml", ".json") else ""
    raise PlanError(f"unknown device {text!r} for {label}; choose {', '.join(DEVICE_NAMES)} or profile:FILE{hint}")


def device_file(device: str) -> str | None:
    """The profile file a `--device` value reads, if any (an input an output must not replace)."""
    return device.removeprefix(PROFILE_PREFIX) if device.startswith(PROFILE_PREFIX) else None


# --------------------------------------------------------------------------------------------
# Options that have no effect


def option_name(parameter: str) -> str:
    """`split_fc1` -> `--split-fc1`."""
    return "--" + parameter.replace("_", "-")


def given(*parameters: str) -> list[str]:
    """Those of `parameters` (Python names) the user set on the command line; none when the
    command function is called directly rather than through the CLI."""
    context = get_current_context(silent=True)
    if context is None:
        return []
    return [p for p in parameters if context.get_parameter_source(p) not in (None, ParameterSource.DEFAULT)]


def refuse_unless(needed: bool, parameters: tuple[str, ...], why: str) -> None:
    """PlanError naming the first of `parameters` the user gave when it has no effect (`needed`
    is False); `why` says when it would have one."""
    if needed:
        return
    extra = given(*parameters)
    if extra:
        raise PlanError(f"{option_name(extra[0])} has no effect here: {why}")


OPTIMIZER_SETTINGS = SETTING_USERS  # option -> the matrix optimizers it changes


def refuse_unused_settings(optimizers: list[str]) -> None:
    """Refuse an optimizer setting none of `optimizers` uses (e.g. --ns-steps with shampoo)."""
    for parameter, users in OPTIMIZER_SETTINGS.items():
        refuse_unless(
            any(name in users for name in optimizers),
            (parameter,),
            f"it only changes {' and '.join(users)}, and the optimizer is {', '.join(optimizers)}",
        )


# --------------------------------------------------------------------------------------------
# Output files

PLAIN_REASONS = {
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
    errno.EROFS: "the file system is read-only",
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "over the disk quota",
    errno.ENAMETOOLONG: "the name is too long",
    errno.ENOENT: "its folder does not accept new files",
    errno.ENOTDIR: "a part of the path is not a folder",
    errno.EISDIR: "it is a folder",
}


def write_output(path: Path, data: str | bytes) -> None:
    """Write `data` to `path` atomically (`write_atomic`); a failed write is one OutputError
    naming the path the user gave and a plain reason, never a temporary file or errno text."""
    try:
        write_atomic(path, data)
    except OSError as error:
        reason = PLAIN_REASONS.get(error.errno or -1, (error.strerror or str(error)).lower())
        raise OutputError(f"cannot write {str(path)!r}: {reason}") from None


def output_path(text: str | Path, label: str = "--output") -> Path:
    """An output option's value as a path; OutputError for an empty one (Path('') is '.')."""
    if not str(text).strip():
        raise OutputError(f"{label} is empty; give a file name")
    return Path(text)
