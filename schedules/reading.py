"""Reading a schedule file safely: bounded size, no YAML anchors, aliases or tags, bounded
nesting, and table rows parsed as JSON without ever composing them as YAML.

A schedule is YAML whose tables are written one JSON object per line (`- {...}`). `schedule_json`
splits the text into those row runs and a small YAML skeleton; the skeleton is scanned event by
event (libyaml's parser streams, so an alias bomb or 100,000 nested brackets are refused before
anything is built) and only then composed; the rows are spliced back as JSON arrays, so the
whole document reaches pydantic as one JSON text. A row line that is not one JSON object
(optionally followed by a `# comment`) is an error naming its line, never a slower parse.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import ValidationError

from canzona.schedules.limits import MAX_EXPANDED_NODES, MAX_NESTING

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_RESOLVER = yaml.resolver.Resolver()
_TYPED_TAGS = {f"tag:yaml.org,2002:{kind}" for kind in ("int", "float", "bool", "null")}
_CANONICAL = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+(?:e[-+][0-9]+)?)?|true|false|null|\.nan|-?\.inf")
_TOKENS_IN_USE = re.compile(r"(?=__canzona_rows(\d+)_)")
_ROW_RUN = re.compile(r"^( *)- \{.*(?:\n(?:\1- \{.*|[ \t\r]*(?:#.*)?$))*", re.MULTILINE)
_COLLECTIONS = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_NODES = (yaml.ScalarEvent, *_COLLECTIONS)
_ENDS = (yaml.MappingEndEvent, yaml.SequenceEndEvent)


class UnsafeDocument(ValueError):
    """A document the reader refuses (one-line message, without the file name)."""


def read_text(path: str | os.PathLike[str], limit: int) -> str:
    """The UTF-8 text of a regular file of at most `limit` bytes: how canzona opens every file
    it reads. Anything else (a folder, a FIFO, a socket, a device; named directly or through a
    symlink) is refused before a byte is read: the path is checked, then opened without
    blocking (a FIFO without a writer would otherwise wait forever) and checked again on the
    open descriptor."""
    try:
        _regular(os.stat(path))
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as error:
        reason = "not a regular file (a socket?)" if error.errno == errno.ENXIO else error.strerror or str(error)
        raise UnsafeDocument(reason) from None
    try:
        size = _regular(os.fstat(descriptor))
        if size > limit:
            raise UnsafeDocument(f"larger than {limit >> 20} MiB")
        data = _read_at_most(descriptor, limit + 1)
    except OSError as error:
        raise UnsafeDocument(error.strerror or str(error)) from None
    finally:
        os.close(descriptor)
    if len(data) > limit:
        raise UnsafeDocument(f"larger than {limit >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise UnsafeDocument(f"not UTF-8 text (byte {error.start})") from None


def _regular(info: os.stat_result) -> int:
    """The size of a regular file; UnsafeDocument for anything else."""
    if stat.S_ISDIR(info.st_mode):
        raise UnsafeDocument("a directory")
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeDocument("not a regular file (a FIFO, a socket or a device)")
    return info.st_size


def _read_at_most(descriptor: int, count: int) -> bytes:
    chunks, left = [], count
    while left > 0:
        chunk = os.read(descriptor, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


@dataclass
class _Run:
    """Consecutive row lines of one table: where it starts and its raw text."""

    first_line: int
    indent: int
    text: str
    rows: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Document:
    """A schedule's text as one JSON document, ready for pydantic."""

    version: Any
    json: str
    runs: tuple[_Run, ...]

    def locate(self, error: ValidationError) -> str | None:
        """For a JSON syntax error: the file line of the first row that is not JSON."""
        if not any(item["type"] == "json_invalid" for item in error.errors()):
            return None
        for run in self.runs:
            for number, line in _row_lines(run):
                try:
                    _without_comment(line[run.indent + 2 :], number)
                except UnsafeDocument as problem:
                    return str(problem)
        return None


def _first_line(text: str) -> str:
    """The first line of an error text, without Python's advice after a semicolon."""
    return (text.strip().splitlines() or [""])[0].split(";")[0]


def _row_lines(run: _Run) -> list[tuple[int, str]]:
    prefix = " " * run.indent + "- {"
    return [(run.first_line + i, line) for i, line in enumerate(run.text.split("\n")) if line.startswith(prefix)]


def _without_comment(row: str, line: int) -> str:
    """A row with a trailing `# comment` cut off; UnsafeDocument if anything else follows it."""
    try:
        _, end = json.JSONDecoder().raw_decode(row)
    except (ValueError, RecursionError) as error:
        raise UnsafeDocument(f"line {line}: a table row is not one JSON object ({_first_line(str(error))})") from None
    rest = row[end:]
    if rest.strip(" \t\r") and not (rest[0] in " \t" and rest.lstrip(" \t").startswith("#")):
        raise UnsafeDocument(f"line {line}: a table row must be one JSON object, optionally followed by a # comment")
    return row[:end]


def _token(text: str) -> str:
    """A placeholder prefix that occurs nowhere in `text`, found in one pass (every serial the
    text holds, overlapping ones included, is skipped)."""
    taken = {int(serial) for serial in _TOKENS_IN_USE.findall(text) if len(serial) < 10}
    serial = next(number for number in range(len(taken) + 1) if number not in taken)
    token = f"__canzona_rows{serial}_"
    if token in text:  # cannot happen: every occurrence was counted
        raise UnsafeDocument("the file holds the reader's placeholder text")
    return token


def _split_rows(text: str, token: str, read_rows: bool = True) -> tuple[str, list[_Run]]:
    """The YAML skeleton (each row run replaced by one placeholder item, line numbers kept) and
    the runs (their rows, a trailing `# comment` cut off, unless `read_rows` is False)."""
    runs: list[_Run] = []
    position, line = 0, 1

    def collect(match: re.Match[str]) -> str:
        nonlocal position, line
        line += text.count("\n", position, match.start())
        position = match.start()
        run = _Run(line, len(match.group(1)), match.group(0))
        prefix = match.group(1) + "- {"
        if read_rows:
            run.rows = [row[run.indent + 2 :] for row in run.text.split("\n") if row.startswith(prefix)]
        if read_rows and "#" in run.text:
            run.rows = [
                _without_comment(row[run.indent + 2 :], number) if "#" in row else row[run.indent + 2 :]
                for number, row in _row_lines(run)
            ]
        runs.append(run)
        return f"{match.group(1)}- {token}{len(runs) - 1}" + "\n" * run.text.count("\n")

    return _ROW_RUN.sub(collect, text), runs


def _repeated_key(text: str) -> str | None:
    """The first key some JSON object of `text` holds twice (keys compared decoded, as every
    JSON reader compares them), or None, also when `text` is not JSON (pydantic refuses that
    with its line)."""
    repeated: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> None:
        if not repeated and len(items) != len({key for key, _ in items}):
            seen: set[str] = set()
            repeated.append(next(key for key, _ in items if key in seen or seen.add(key)))  # type: ignore[func-returns-value]

    try:
        json.loads(text, object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return None
    return repeated[0] if repeated else None


def _check_row_keys(runs: list[_Run]) -> None:
    """UnsafeDocument naming the line of the first table row that holds a key twice (JSON
    readers keep the last one, so a reviewer reading the first would be misled). One pass over
    every row; rows one by one only when that pass cannot decide."""
    rows = [row for run in runs for row in run.rows]
    if not rows or _all_rows_unique(rows):
        return
    for run in runs:
        for position, row in enumerate(run.rows):
            key = _repeated_key(row)
            if key is not None:
                number = _row_lines(run)[position][0]
                raise UnsafeDocument(f"line {number}: key {key[:40]!r} appears twice in a table row")


def _all_rows_unique(rows: list[str]) -> bool:
    """Whether every row parses as JSON in one pass and no object of them repeats a key."""
    repeated: list[bool] = []

    def pairs(items: list[tuple[str, Any]]) -> None:
        if len(items) != len({key for key, _ in items}):
            repeated.append(True)

    try:
        json.loads("[" + ",".join(rows) + "]", object_pairs_hook=pairs)
    except (ValueError, RecursionError):
        return False
    return not repeated


class _Scanner:
    """Checks libyaml's event stream (nothing is composed): no tags, no complex or duplicate
    keys, nesting at most MAX_NESTING; and either no anchors, aliases or merge keys at all
    (schedules), or aliases whose expansion stays under MAX_EXPANDED_NODES (other inputs, which
    PyYAML may itself have written with anchors)."""

    def __init__(self, allow_aliases: bool) -> None:
        self.allow_aliases = allow_aliases
        self.canonical = not allow_aliases  # schedules: numbers, booleans and null as canzona writes them
        # one per open collection: [is mapping, expecting a key, keys, expanded count at start, anchor, last key]
        self.frames: list[list[Any]] = []
        self.anchors: dict[str, int] = {}
        self.expanded = 0

    def scan(self, text: str) -> None:
        """UnsafeDocument at the first refused event."""
        for event in yaml.parse(text, Loader=_Loader):
            where = f"line {event.start_mark.line + 1}: " if event.start_mark is not None else ""
            self._event(event, where)

    def _event(self, event: Any, where: str) -> None:
        anchor = getattr(event, "anchor", None)
        if isinstance(event, yaml.AliasEvent) or anchor is not None:
            if not self.allow_aliases:
                raise UnsafeDocument(f"{where}YAML anchors and aliases (&, *) are not allowed in a schedule")
        if getattr(event, "tag", None) is not None:
            raise UnsafeDocument(f"{where}YAML tags (!) are not allowed")
        if isinstance(event, yaml.DocumentStartEvent) and event.tags:
            raise UnsafeDocument(f"{where}YAML %TAG directives are not allowed")
        if isinstance(event, (*_NODES, yaml.AliasEvent)) and self.frames and self.frames[-1][0]:
            self._key(event, self.frames[-1], where)
        if isinstance(event, yaml.AliasEvent):
            self._grow(self.anchors.get(event.anchor, 1), where)
        elif isinstance(event, yaml.ScalarEvent):
            self._grow(1, where)
            if self.canonical and not event.style and event.implicit[0]:  # plain (libyaml: "", PyYAML: None)
                key = self.frames[-1][5] if self.frames and self.frames[-1][0] and self.frames[-1][1] else None
                _check_spelling(event.value, where + (f"{str(key)[:40]}: " if key is not None else ""))
            if anchor is not None:
                self.anchors[anchor] = 1
        elif isinstance(event, _COLLECTIONS):
            self._grow(1, where)
            self.frames.append([isinstance(event, yaml.MappingStartEvent), True, set(), self.expanded, anchor, None])
            if len(self.frames) > MAX_NESTING:
                raise UnsafeDocument(f"{where}nested deeper than {MAX_NESTING} levels")
        elif isinstance(event, _ENDS):
            frame = self.frames.pop()
            if frame[4] is not None:
                self.anchors[frame[4]] = self.expanded - frame[3] + 1

    def _grow(self, nodes: int, where: str) -> None:
        self.expanded += nodes
        if self.expanded > MAX_EXPANDED_NODES:
            raise UnsafeDocument(f"{where}the document expands to more than {MAX_EXPANDED_NODES} values (aliases?)")

    def _key(self, event: Any, frame: list[Any], where: str) -> None:
        if frame[1]:
            if not isinstance(event, yaml.ScalarEvent):
                raise UnsafeDocument(f"{where}mapping keys must be plain names")
            if event.implicit[0] and event.value == "<<" and not self.allow_aliases:
                raise UnsafeDocument(f"{where}YAML merge keys (<<) are not allowed in a schedule")
            if event.value in frame[2]:
                raise UnsafeDocument(f"{where}key {event.value!r} appears twice")
            frame[2].add(event.value)
            frame[5] = event.value
        frame[1] = not frame[1]


def _check_spelling(value: str, where: str) -> None:
    """A plain scalar YAML reads as a number, a boolean or null must be spelled as canzona
    writes it: YAML 1.1 also reads 0x2, 1_000, 0o17, 1:30, yes or ~, which a reviewer may
    not read as YAML does."""
    if _CANONICAL.fullmatch(value):
        return
    if _RESOLVER.resolve(yaml.ScalarNode, value, (True, False)) in _TYPED_TAGS:
        raise UnsafeDocument(
            f"{where}{value[:40]!r} is not spelled as canzona writes numbers, booleans and null "
            "(plain decimal, true, false, null)"
        )


def _not_json(value: Any) -> Any:
    raise UnsafeDocument(f"a value is not plain data ({type(value).__name__}: {str(value)[:40]!r})")


def _load_skeleton(skeleton: str, allow_aliases: bool = False) -> Any:
    try:
        _Scanner(allow_aliases).scan(skeleton)
        return yaml.load(skeleton, Loader=_Loader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise UnsafeDocument(f"not valid YAML{where}") from None
    except UnsafeDocument:
        raise
    except ValueError as error:  # e.g. an integer past Python's digit limit
        raise UnsafeDocument(f"a value cannot be read ({_first_line(str(error))})") from None


def safe_load(text: str) -> Any:
    """Any other YAML or JSON document canzona reads (model files, profiles, shapes lists): no
    tags or duplicate keys, bounded nesting, aliases only while their expansion stays small.
    UnsafeDocument (one line) otherwise."""
    return _load_skeleton(text.removeprefix("\ufeff"), allow_aliases=True)


def schedule_skeleton(text: str) -> dict[str, Any]:
    """A schedule's YAML without its tables (each a placeholder), read as safely as the whole
    file: what is left to read when its rows are damaged (the request)."""
    text = text.removeprefix("\ufeff")
    skeleton, _ = _split_rows(text, _token(text), read_rows=False)
    data = _load_skeleton(skeleton)
    if not isinstance(data, dict):
        raise UnsafeDocument("not a schedule file (expected a mapping)")
    return data


def _plain_line_breaks(text: str) -> str:
    """`text` with CR LF and lone CR line breaks as LF, so that the row reader (which splits at
    LF) sees every row YAML would; UnsafeDocument on the other breaks YAML 1.1 knows (NEL, LS,
    PS), which canzona never writes raw."""
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    odd = next((char for char in ("\x85", "\u2028", "\u2029") if char in text), None)
    if odd is not None:
        line = text.count("\n", 0, text.index(odd)) + 1
        raise UnsafeDocument(f"line {line}: a raw {odd!r} line break (canzona writes only LF; an editor put it there)")
    return text


def schedule_json(text: str) -> Document:
    """The schedule text as one JSON document (UnsafeDocument on anything unusual)."""
    text = _plain_line_breaks(text.removeprefix("\ufeff"))
    token = _token(text)
    skeleton, runs = _split_rows(text, token)
    data = _load_skeleton(skeleton)
    if not isinstance(data, dict):
        raise UnsafeDocument("not a schedule file (expected a mapping)")
    _check_row_keys(runs)
    try:
        skeleton_json = json.dumps(data, ensure_ascii=True, default=_not_json)
    except TypeError as error:  # a mapping key that JSON cannot spell
        raise UnsafeDocument(f"a key is not plain data ({_first_line(str(error))})") from None
    placeholder = re.compile(r'\["' + re.escape(token) + r'(\d{1,9})"\]')
    used: set[int] = set()

    def splice(match: re.Match[str]) -> str:
        index = int(match.group(1))
        if index >= len(runs) or index in used:  # the token spelled with YAML escapes in a value
            raise UnsafeDocument("a value holds the reader's placeholder text")
        used.add(index)
        return "[" + ",".join(runs[index].rows) + "]"

    joined = placeholder.sub(splice, skeleton_json)
    if len(used) != len(runs):
        first = min(set(range(len(runs))) - used)
        raise UnsafeDocument(f"line {runs[first].first_line}: table rows are mixed with other YAML in one list")
    return Document(data.get("schema_version"), joined, tuple(runs))
