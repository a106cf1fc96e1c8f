"""The checked-in schedule library, shipped as package data: names like
`qwen3-32b/muon-tp8-dp32` resolve to files inside `canzona.schedules`."""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path


def library_root() -> Path:
    """The folder holding the shipped schedules."""
    return Path(str(files("canzona.schedules")))


def library_names() -> list[str]:
    """Every shipped schedule's name (path below the library, without .yaml)."""
    root = library_root()
    return sorted(
        p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.yaml") if "profiles" not in p.parts
    )


def resolve_schedule(name_or_path: str | os.PathLike[str]) -> Path:
    """A path that exists as given, else the library schedule of that name, else the path
    as given (so reading it reports the missing file)."""
    path = Path(name_or_path)
    if path.exists():
        return path
    candidate = library_root() / f"{str(name_or_path).removesuffix('.yaml')}.yaml"
    if candidate.is_file() and "profiles" not in candidate.parts:
        return candidate
    return path
