"""Fuzz the schedule reader with the mutation classes of issue 14 (fixed seed, a few hundred
cases, seconds): every mutated file is either accepted with the plan unchanged or refused with
one line as a ScheduleError; a sample goes through the CLI (exit 0 or 2, one line)."""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from functools import cache
from pathlib import Path

import pytest

from canzona.cli.main import main
from canzona.planner.compile import compile_schedule
from canzona.planner.plan import PlanRequest, make_plan
from canzona.planner.sources.load import load_model
from canzona.schedules.format import Schedule, ScheduleError, dump_schedule, read_schedule

ROOT = Path(__file__).resolve().parents[2]
SEED = 14
CASES_PER_CLASS = 40
NUMBER = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?:e[-+]?\d+)?(?![\w.])")
ODD_NUMBERS = ["0", "-1", "1", "2", "99", "1e308", "1e999", "-0.0", "NaN", ".nan", ".inf", "1" * 40, "0x10", "1_000"]
TRICKS = [
    "&a ",
    "*a ",
    "!!str ",
    "!!python/object:os.system ",
    "<<: {a: 1}\n",
    "? [k]\n: v\n",
    "[" * 5000,
    "{a: " * 50,
    "%TAG !x! tag:x,2000:\n---\n",
    "---\n",
    "\t",
    "\x00",
    "\ufeff",
    "# comment\n",
    "'",
    '"',
    "\\u0000",
]


@cache
def originals() -> tuple[Schedule, ...]:
    """A dense TP x DP schedule and a MoE one with EP fields, both small and fast to parse."""
    dense = PlanRequest(str(ROOT / "examples" / "tiny_qwen3.yaml"), 2, 2, bucket_size=20000, group_bytes=40000)
    moe = PlanRequest(
        str(ROOT / "tests" / "runtime" / "data" / "tiny_moe.json"), 2, 4, ep=2, bucket_size=2000, group_bytes=4096
    )
    return tuple(compile_schedule(make_plan(load_model(r.model, r.tp), r)) for r in (dense, moe))


def flip_byte(data: bytes, rng: random.Random) -> bytes:
    position = rng.randrange(len(data))
    return data[:position] + bytes([data[position] ^ (1 << rng.randrange(8))]) + data[position + 1 :]


def truncate(data: bytes, rng: random.Random) -> bytes:
    return data[: rng.randrange(len(data))]


def edit_number(data: bytes, rng: random.Random) -> bytes:
    text = data.decode()
    matches = list(NUMBER.finditer(text))
    match = rng.choice(matches)
    old = match.group()
    new = rng.choice(
        [
            str(int(float(old)) + rng.choice([-1, 1, 64]))
            if "." not in old and "e" not in old
            else repr(float(old) * rng.choice([0.5, 1.0000001, 2.0])),
            *ODD_NUMBERS,
        ]
    )
    return (text[: match.start()] + new + text[match.end() :]).encode()


def _lines(data: bytes) -> list[bytes]:
    return data.split(b"\n")


def swap_lines(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
    lines[i], lines[j] = lines[j], lines[i]
    return b"\n".join(lines)


def drop_or_duplicate_line(data: bytes, rng: random.Random) -> bytes:
    lines = _lines(data)
    i = rng.randrange(len(lines))
    lines[i : i + 1] = [] if rng.random() < 0.5 else [lines[i], lines[i]]
    return b"\n".join(lines)


def remove_key(data: bytes, rng: random.Random) -> bytes:
    text = data.decode()
    keys = list(re.finditer(r'(?m)"\w+": (?:\[[^\]]*\]|[^,}]*)(?:, )?|^ *\w+: .*\n', text))
    match = rng.choice(keys)
    return (text[: match.start()] + text[match.end() :]).encode()


def add_key(data: bytes, rng: random.Random) -> bytes:
    text = data.decode()
    if rng.random() < 0.5:
        braces = [m.start() for m in re.finditer(r"\{", text)]
        at = rng.choice(braces) + 1
        return (text[:at] + rng.choice(['"extra": 1, ', '"owner": 0, ', '"ep_rank": 0, ']) + text[at:]).encode()
    lines = text.split("\n")
    i = rng.randrange(len(lines))
    indent = len(lines[i]) - len(lines[i].lstrip(" "))
    lines.insert(i, " " * indent + rng.choice(["extra: 1", "tp: 4", "ep: 2", "order: free"]))
    return "\n".join(lines).encode()


def yaml_trick(data: bytes, rng: random.Random) -> bytes:
    text = data.decode()
    at = rng.randrange(len(text))
    return (text[:at] + rng.choice(TRICKS) + text[at:]).encode("utf-8", "surrogatepass")


MUTATIONS: tuple[Callable[[bytes, random.Random], bytes], ...] = (
    flip_byte,
    truncate,
    edit_number,
    swap_lines,
    drop_or_duplicate_line,
    remove_key,
    add_key,
    yaml_trick,
)


def mutated_files(folder: Path) -> list[tuple[Path, Schedule]]:
    rng = random.Random(SEED)
    cases = []
    for mutate in MUTATIONS:
        for case in range(CASES_PER_CLASS):
            original = originals()[case % len(originals())]
            path = folder / f"{mutate.__name__}-{case}.yaml"
            path.write_bytes(mutate(dump_schedule(original).encode(), rng))
            cases.append((path, original))
    return cases


def test_every_mutation_is_accepted_unchanged_or_refused_in_one_line(tmp_path: Path) -> None:
    cases = mutated_files(tmp_path)
    outcomes = {"accepted": 0, "refused": 0}
    for path, original in cases:
        try:
            schedule = read_schedule(path)
        except ScheduleError as error:  # the only exception type allowed out of the reader
            message = str(error)
            assert message.startswith(f"{path}: ") or message.startswith(f"cannot read schedule {str(path)!r}")
            assert "\n" not in message, message
            outcomes["refused"] += 1
            continue
        assert schedule == original, f"{path.name} was accepted with a different plan"
        outcomes["accepted"] += 1
    assert outcomes["refused"] > len(cases) // 2  # the mutations do bite
    assert sum(outcomes.values()) == len(MUTATIONS) * CASES_PER_CLASS


def test_a_cli_sample_exits_0_or_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cases = mutated_files(tmp_path)[:: len(MUTATIONS)]  # one in eight, every class
    for path, _ in cases:
        for args in (["show", str(path)], ["simulate", str(path)], ["show", str(path), "--rank", "1", "--json"]):
            code = main(args)
            out, err = capsys.readouterr()
            assert code in (0, 2), (args, err)
            assert "Traceback" not in err and "internal error" not in err
            if code == 2:
                assert out == "" and err.startswith("canzona: error: ") and err.count("\n") == 1
