"""Writing files so that a failed or killed run never damages anything.

Every file canzona writes (schedules, profiles, the library README's table, pictures) goes
through `write_atomic`: the bytes go to a temporary file in the target's folder, are fsync'd,
get the target's permissions, and are renamed over the target in one step.

- A new file gets the permissions the umask gives (0666 & ~umask); an existing file keeps its
  mode.
- A symlink is written through: its target is replaced atomically, the link stays.
- A target that exists but is not a regular file (a folder, /dev/full, a FIFO) is refused.
- Unchanged bytes are not rewritten (the file, its mode and its mtime stay as they are).
- Temporary files are named `.<name>.<pid>.<random>.canzona-tmp`: nothing that lists
  `*.yaml` sees them, they are removed when the write fails or the process gets SIGINT/SIGTERM
  (the CLI turns both into exceptions), and a later write into the same folder removes those a
  killed process left behind.

`check_output` refuses, before any work starts, an output path that cannot be written or that
is one of the command's inputs.
"""

from __future__ import annotations

import os
import stat
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

TEMP_SUFFIX = ".canzona-tmp"
STALE_AFTER_S = 3600  # a temp file this old is stale even if its pid was reused


class OutputError(ValueError):
    """An output path canzona refuses to write (one-line message)."""


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_target(path: str | os.PathLike[str]) -> Path:
    """The file a write to `path` replaces: `path` itself, or a symlink's final target.
    OutputError for an empty path or an existing target that is not a regular file."""
    if not str(path):
        raise OutputError("the output path is empty")
    target = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    except NotADirectoryError:
        blocking = next(p for p in target.parents if p.exists())
        raise OutputError(f"cannot write {str(path)!r}: {str(blocking)!r} is not a folder") from None
    except OSError as error:
        raise OutputError(f"cannot write {str(path)!r}: {error.strerror}") from None
    if stat.S_ISDIR(mode):
        raise OutputError(f"cannot write {str(path)!r}: it is a folder")
    if not stat.S_ISREG(mode):
        raise OutputError(f"cannot write {str(path)!r}: not a regular file")
    return target


def _same_file(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_output(
    path: str | os.PathLike[str], inputs: Iterable[str | os.PathLike[str] | None] = (), label: str = "output"
) -> Path:
    """Refuse, before any work, an output path that resolves to one of `inputs`, that is not a
    regular file, or whose folder cannot be made or written. Returns the file to replace."""
    target = write_target(path)
    for source in inputs:
        if source is not None and str(source) and Path(source).exists() and _same_file(target, Path(source)):
            raise OutputError(f"the {label} {str(path)!r} is also an input ({str(source)!r}); choose another path")
    folder = target.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise OutputError(f"cannot write {str(path)!r}: {str(folder)!r} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"cannot write {str(path)!r}: {str(folder)!r} is not writable")
    return target


def _remove_stale_temporaries(folder: Path) -> None:
    """Temporary files in `folder`, of any target, whose writer is gone (or that are older than
    an hour): what a killed writer (SIGKILL) left behind."""
    now = time.time()
    for leftover in folder.glob(".*" + TEMP_SUFFIX):
        parts = leftover.name[: -len(TEMP_SUFFIX)].rsplit(".", 2)  # ".<name>", pid, random
        try:
            pid = int(parts[1]) if len(parts) == 3 else -1
            if pid < 0 or (_alive(pid) and now - leftover.stat().st_mtime < STALE_AFTER_S):
                continue
            leftover.unlink(missing_ok=True)
        except (ValueError, OSError):  # not ours, or gone meanwhile
            continue


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_atomic(path: str | os.PathLike[str], data: str | bytes) -> bool:
    """Replace the file at `path` (through a symlink) with `data` atomically; False when it
    already held exactly these bytes (nothing is written). OutputError for a refused target,
    OSError when the disk write fails (the old file is then untouched)."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    target = write_target(path)
    try:
        if target.is_file() and target.stat().st_size == len(payload) and target.read_bytes() == payload:
            return False
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mode = 0o666 & ~_umask()
    if not os.path.islink(path):
        target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(target.parent)
    handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.{os.getpid()}.", suffix=TEMP_SUFFIX, dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(payload)
            stream.flush()
            os.fchmod(stream.fileno(), mode)
            os.fsync(stream.fileno())
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return True
