"""Writing a schedule's YAML text: deterministic (same schedule, same bytes), table rows one
JSON object per line (which YAML reads as flow mappings), fields at their default left out.
`format.write_schedule` writes the text atomically; `reading` reads it back. Imports nothing
of the format but the `Schedule` type."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from canzona.schedules.models import Schedule

_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_ROW_LINE = re.compile(r"^( *)- (__canzona_rows_\d+__)$", re.MULTILINE)
_YAML_UNSAFE = re.compile("[^\x09\x0a\x0d\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


def _is_flat(value: Any) -> bool:
    if isinstance(value, list):
        return all(_is_flat(item) and not isinstance(item, dict) for item in value)
    return value is None or isinstance(value, (str, int, float, bool))


def _is_table(node: Any) -> bool:
    """A non-empty list of mappings whose values are scalars or lists of scalars."""
    return (
        isinstance(node, list)
        and bool(node)
        and all(isinstance(row, dict) and all(_is_flat(v) for v in row.values()) for row in node)
    )


def flow_value(value: Any) -> str:
    """JSON text of a flat value (scalars, lists, one-level mappings) that YAML reads back as
    the same value: floats spelled as YAML 1.1 reads them (always a dot), characters YAML
    refuses escaped. What table rows are written with, here and in parameter lists."""
    return _flow(value)


def _flow(value: Any) -> str:
    """JSON text of a flat value, with floats spelled as YAML 1.1 reads them (always a dot)."""
    if isinstance(value, str):
        # Not ensure_ascii: JSON would spell non-BMP characters as surrogate pairs, which YAML
        # reads differently. Raw UTF-8 reads the same in both, except characters YAML refuses
        # or reads as line breaks: those get \u escapes, which both read alike.
        return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(value, ensure_ascii=False))
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        text = repr(value).lower()
        return text.replace("e", ".0e") if "." not in text and "e" in text else text
    if isinstance(value, list):
        return "[" + ", ".join(_flow(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_flow(k)}: {_flow(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def dump_schedule(schedule: Schedule) -> str:
    """The YAML text of a schedule (deterministic: same schedule, same bytes).

    Table rows (one parameter, one bucket) are written one per line as JSON objects, which
    YAML reads as flow mappings: the file diffs line by line and loads fast (`parse_schedule`).
    Fields at their default value are left out (as in the digest).
    """
    tables: list[list[dict[str, Any]]] = []

    def extract(node: Any) -> Any:
        if _is_table(node):
            tables.append(node)
            return [f"__canzona_rows_{len(tables) - 1}__"]
        if isinstance(node, dict):
            return {key: extract(value) for key, value in node.items()}
        if isinstance(node, list):
            return [extract(item) for item in node]
        return node

    data = schedule.model_dump(mode="json", exclude_defaults=True)
    skeleton = yaml.dump(extract(data), Dumper=_Dumper, sort_keys=False, width=1 << 16)

    def rows(match: re.Match[str]) -> str:
        indent, table = match.group(1), tables[int(match.group(2)[len("__canzona_rows_") : -2])]
        return "\n".join(f"{indent}- {_flow(row)}" for row in table)

    return _ROW_LINE.sub(rows, skeleton)
