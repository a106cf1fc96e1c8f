"""Writing a schedule's YAML text: deterministic (same schedule, same bytes), table rows one
JSON object per line (which YAML reads as flow mappings), fields at their default left out.
`format.write_schedule` writes the text atomically; `reading` reads it back. Imports nothing
of the format but the `Schedule` type."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from json.encoder import encode_basestring  # what json.dumps(text, ensure_ascii=False) spells a str with
from typing import Any

import yaml

from canzona.schedules.collector import collector_paused
from canzona.schedules.models import Schedule

_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_ROW_LINE = re.compile(r"^( *)- (__canzona_rows_\d+__)$", re.MULTILINE)
_YAML_UNSAFE = re.compile("[^\x09\x0a\x0d\x20-\x7e\xa0-\u2027\u202a-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_INT_ONLY = frozenset({int})


def _is_flat(value: Any) -> bool:
    """A scalar, or a list of flat values that are not mappings (what a table row's field holds)."""
    if isinstance(value, list):
        return all(_is_flat(item) and not isinstance(item, dict) for item in value)
    return value is None or isinstance(value, (str, int, float, bool))


def flow_value(value: Any) -> str:
    """JSON text of a flat value (scalars, lists, one-level mappings) that YAML reads back as
    the same value: floats spelled as YAML 1.1 reads them (always a dot), characters YAML
    refuses escaped. What table rows are written with, here and in parameter lists."""
    return _flow(value)


def _string(value: str) -> str:
    """A str as JSON text YAML reads alike.

    Not ensure_ascii: JSON would spell non-BMP characters as surrogate pairs, which YAML reads
    differently. Raw UTF-8 reads the same in both, except characters YAML refuses or reads as
    line breaks: those get \\u escapes, which both read alike. Printable ASCII (every name a
    schedule holds, in practice) has none of those, so only other text is searched for them."""
    text: str = encode_basestring(value)
    if text.isascii() and text.isprintable():
        return text
    return _YAML_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def _float(value: float) -> str:
    """A float as YAML 1.1 reads it: always with a dot (1.0e-05, not 1e-05)."""
    text = repr(value).lower()
    return text.replace("e", ".0e") if "." not in text and "e" in text else text


def _flow(value: Any) -> str:
    """JSON text of a flat value, with floats spelled as YAML 1.1 reads them (always a dot)."""
    if isinstance(value, str):
        return _string(value)
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return _float(value)
    if isinstance(value, list):
        return "[" + ", ".join(_flow(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_flow(k)}: {_flow(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)


def _flat_list(value: list[Any]) -> str | None:
    """`_flat_text` of a list: its items' texts, or None when one of them is not flat."""
    if set(map(type, value)) == _INT_ONLY:  # cuts, shapes, loads: a plain int is its own JSON
        return "[" + ", ".join(map(str, value)) + "]"
    texts = []
    for item in value:
        text = _flat_text(item)
        if text is None:
            return None
        texts.append(text)
    return "[" + ", ".join(texts) + "]"


_FLAT_TEXT: dict[type, Callable[[Any], str | None]] = {
    int: str,
    str: _string,
    float: _float,
    bool: json.dumps,
    type(None): json.dumps,
    list: _flat_list,
    dict: lambda _: None,
}
"""`_flat_text` by exact type: what `_flow` writes, or None for a mapping (never flat)."""


def _flat_text(value: Any) -> str | None:
    """`_flow(value)` when `_is_flat(value)`, else None: one pass over the value that both
    decides and writes. The types a JSON dump holds are dispatched on exactly; any other
    (a subclass) takes the general path."""
    write = _FLAT_TEXT.get(type(value))
    if write is not None:
        return write(value)
    return _flow(value) if _is_flat(value) else None


def _row_texts(node: list[Any], keys: dict[str, str]) -> list[str] | None:
    """The rows of a table as `_flow` writes them, or None when `node` is not a table (a
    non-empty list of mappings whose values are flat: scalars or lists of them). `keys`: the
    text of every field name met so far, with its ": " (a table repeats its names on every row)."""
    if not node:
        return None
    texts = []
    for row in node:
        if not isinstance(row, dict):
            return None
        fields = []
        for key, value in row.items():
            text = _flat_text(value)
            if text is None:
                return None
            name = keys.get(key)
            if name is None:
                name = _flow(key) + ": "
                if type(key) is str:  # 1, 1.0 and True are one key of a mapping, but three texts
                    keys[key] = name
            fields.append(name + text)
        texts.append("{" + ", ".join(fields) + "}")
    return texts


def dump_schedule(schedule: Schedule) -> str:
    """The YAML text of a schedule (deterministic: same schedule, same bytes).

    Table rows (one parameter, one bucket) are written one per line as JSON objects, which
    YAML reads as flow mappings: the file diffs line by line and loads fast (`parse_schedule`).
    Fields at their default value are left out (as in the digest).
    """
    tables: list[list[str]] = []
    keys: dict[str, str] = {}

    def extract(node: Any) -> Any:
        if isinstance(node, list):
            rows = _row_texts(node, keys)
            if rows is not None:
                tables.append(rows)
                return [f"__canzona_rows_{len(tables) - 1}__"]
            return [extract(item) for item in node]
        if isinstance(node, dict):
            return {key: extract(value) for key, value in node.items()}
        return node

    with collector_paused():
        data = schedule.model_dump(mode="json", exclude_defaults=True)
        skeleton = yaml.dump(extract(data), Dumper=_Dumper, sort_keys=False, width=1 << 16)

    def rows(match: re.Match[str]) -> str:
        indent, table = match.group(1), tables[int(match.group(2)[len("__canzona_rows_") : -2])]
        return "\n".join(f"{indent}- {row}" for row in table)

    return _ROW_LINE.sub(rows, skeleton)
