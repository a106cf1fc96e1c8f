"""Property (issue 27): every truncation and every single-byte change of a real schedule is, for
each of the four readers (`show`, `check`, `simulate` and the runtime's `load_schedule`), either
refused cleanly in one line or accepted, within 200 MB, and the readers agree on which.

Memory is the peak of Python's allocations during the call (tracemalloc: the readers' own
objects, pydantic's models included): a bound on work done, which holds on a busy machine as on
an idle one. Speed is measured in benchmarks/, not here."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from canzona.cli.main import main
from canzona.runtime import load_schedule
from canzona.schedules.format import ScheduleError

ROOT = Path(__file__).resolve().parents[2]
BYTES = 200 << 20
WORST: dict[str, int] = {}


@pytest.fixture(scope="module")
def seed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    """A dense TP 2 x DP 2 schedule of the tiny example model (row blocks, teams, two buckets)."""
    folder = tmp_path_factory.mktemp("seed")
    target = folder / "seed.yaml"
    assert (
        main(
            [
                "plan",
                "--model",
                str(ROOT / "examples" / "tiny_qwen3.yaml"),
                "--tp",
                "2",
                "--dp",
                "2",
                "--bucket-size",
                "20000",
                "-o",
                str(target),
            ]
        )
        == 0
    )
    return folder, target.read_bytes()


def measured(label: str, call: Callable[[], object]) -> object:
    """`call()` under the memory bound; the worst peak seen is kept in WORST."""
    tracemalloc.start()
    try:
        return call()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        WORST[label] = max(WORST.get(label, 0), peak)
        assert peak < BYTES, f"{label} allocated {peak >> 20} MiB"


def command(args: list[str], capsys: pytest.CaptureFixture[str]) -> bool:
    """Run `canzona ARGS`; True if it accepted the file. A refusal is exit 2 with one line."""
    code = measured(args[0], lambda: main(args))
    out, err = capsys.readouterr()
    assert "internal error" not in err and "Traceback" not in err, (args, err)
    if code == 2:
        assert out == "" and err.startswith("canzona: error: ") and err.count("\n") == 1, (args, err)
        return False
    assert code == 0 or (args[0] == "check" and code == 1), (args, code, err)  # check: 1 = stale bytes
    return True


def loaded(path: Path) -> bool:
    try:
        measured("load_schedule", lambda: load_schedule(path))
    except ScheduleError as error:
        assert "\n" not in str(error)
        return False
    return True


def mutations(size: int) -> st.SearchStrategy[tuple[str, int, int]]:
    """('cut', position, 0): the first `position` bytes; ('byte', position, value): one byte changed."""
    return st.one_of(
        st.tuples(st.just("cut"), st.integers(0, size - 1), st.just(0)),
        st.tuples(st.just("byte"), st.integers(0, size - 1), st.integers(0, 255)),
    )


@pytest.mark.timeout(240)
def test_every_reader_refuses_or_accepts_a_damaged_schedule_in_bounded_time(
    seed: tuple[Path, bytes], capsys: pytest.CaptureFixture[str]
) -> None:
    folder, original = seed
    path = folder / "damaged.yaml"

    @settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
    @given(mutations(len(original)))
    @example(("cut", 0, 0))
    @example(("byte", len(original) // 2, 0))  # a NUL byte
    @example(("byte", 0, ord("\t")))
    def check(mutation: tuple[str, int, int]) -> None:
        kind, position, value = mutation
        damaged = (
            original[:position] if kind == "cut" else original[:position] + bytes([value]) + original[position + 1 :]
        )
        path.write_bytes(damaged)
        verdicts = {
            "show": command(["show", str(path)], capsys),
            "simulate": command(["simulate", str(path)], capsys),
            "check": command(["check", str(path)], capsys),
            "load_schedule": loaded(path),
        }
        assert len(set(verdicts.values())) == 1, (mutation, verdicts)
        if damaged == original:
            assert verdicts["show"]

    check()
    assert set(WORST) == {"show", "simulate", "check", "load_schedule"}
    print("worst per reader:", ", ".join(f"{name} {peak / (1 << 20):.1f} MiB" for name, peak in sorted(WORST.items())))
