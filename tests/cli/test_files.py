"""Files are never damaged: atomic writes, permissions, symlinks, special files, outputs that
are inputs, temporary files after failures and signals, byte-identical re-plans."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from canzona.cli.main import main
from canzona.schedules import files
from canzona.schedules.files import TEMP_SUFFIX, write_atomic
from canzona.schedules.library import library_root

from cli_run import run

PLAN = ["plan", "--model", "qwen3-0.6b", "--dp", "2"]
MODEL = "name: m\nparams:\n- {name: w1, shape: [64, 64], tp_dim: 0}\n- {name: w2, shape: [64, 128], tp_dim: 1}\n"


def one_line_error(err: str, *needles: str) -> None:
    assert err.startswith("canzona: error: ") and err.count("\n") == 1, err
    for needle in needles:
        assert needle in err, err


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_files_follow_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    previous = os.umask(umask)
    try:
        write_atomic(tmp_path / "new.yaml", "a: 1\n")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "new.yaml").stat().st_mode) == mode


def test_an_existing_files_mode_is_kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "s.yaml"
    assert main([*PLAN, "-o", str(target)]) == 0
    target.chmod(0o640)
    assert main([*PLAN, "--alpha", "0.5", "--force", "-o", str(target)]) == 0  # another plan: rewritten
    assert stat.S_IMODE(target.stat().st_mode) == 0o640


def test_unchanged_bytes_are_not_rewritten(tmp_path: Path) -> None:
    target = tmp_path / "s.yaml"
    assert write_atomic(target, "a: 1\n")
    before = target.stat()
    time.sleep(0.01)
    assert not write_atomic(target, "a: 1\n")
    after = target.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_symlinks_are_written_through(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    real = tmp_path / "real" / "s.yaml"
    real.parent.mkdir()
    real.write_text("old\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(real)
    assert main([*PLAN, "--force", "-o", str(link)]) == 0  # "old" is no schedule: replaced only by force
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text().startswith("schema_version:")
    assert sorted(os.listdir(real.parent)) == ["s.yaml"]


@pytest.mark.parametrize("kind", ["folder", "fifo", "device"])
def test_non_regular_targets_are_refused(tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "target.yaml"
    if kind == "folder":
        target.mkdir()
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        target = Path("/dev/full")
        if not target.exists():
            pytest.skip("no /dev/full here")
    before = target.lstat()
    code, out, err = run([*PLAN, "-o", str(target)], capsys)
    assert code == 2 and out == ""
    one_line_error(err, "cannot write", "folder" if kind == "folder" else "not a regular file")
    assert stat.S_IFMT(target.lstat().st_mode) == stat.S_IFMT(before.st_mode)  # /dev/full is still a device


def test_a_link_to_a_device_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if not Path("/dev/null").exists():
        pytest.skip("no /dev/null here")
    link = tmp_path / "null.yaml"
    link.symlink_to("/dev/null")
    code, _, err = run([*PLAN, "-o", str(link)], capsys)
    assert code == 2 and link.is_symlink()
    one_line_error(err, "not a regular file")


def test_an_output_that_is_an_input_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "m.yaml"
    model.write_text(MODEL)
    alias = tmp_path / "alias.yaml"
    alias.symlink_to(model)
    hard = tmp_path / "hard.yaml"
    os.link(model, hard)
    for output in (model, alias, hard):
        code, _, err = run(["plan", "--model", str(model), "--dp", "2", "-o", str(output)], capsys)
        assert code == 2
        one_line_error(err, "is also an input")
    assert model.read_text() == MODEL
    profile = library_root() / "profiles" / "cpu-dev.yaml"
    copy = tmp_path / "p.yaml"
    shutil.copy(profile, copy)
    code, _, err = run([*PLAN, "--cost", f"profile:{copy}", "-o", str(copy)], capsys)
    assert code == 2
    one_line_error(err, "is also an input")


def test_calibrate_checks_its_output_before_timing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from canzona.cli import calibrate_cmd

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("timing started")

    monkeypatch.setattr(calibrate_cmd, "_run_calibration", never)
    shapes = tmp_path / "s.yaml"
    shapes.write_text("- [8, 8]\n")
    for output, needle in ((shapes, "is also an input"), (tmp_path, "folder"), (shapes / "x.yaml", "not a folder")):
        code, _, err = run(["calibrate", "--shapes", str(shapes), "-o", str(output)], capsys)
        assert code == 2
        one_line_error(err, needle)
    for option in (
        ["--ns-steps", "0"],
        ["--precondition-frequency", "0"],
        ["--max-precond-dim", "0"],
        ["--threads", "100000"],
        ["--block-size", "0"],
        ["--repeats", "0"],
        ["--comm-ranks", "1"],
    ):
        code, _, err = run(["calibrate", "--shapes", str(shapes), "-o", str(tmp_path / "p.yaml"), *option], capsys)
        assert code == 2
        one_line_error(err)
    assert shapes.read_text() == "- [8, 8]\n"


def test_stale_temporaries_are_cleaned_and_live_ones_kept(tmp_path: Path) -> None:
    target = tmp_path / "s.yaml"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".s.yaml.{dead.pid}.abc{TEMP_SUFFIX}"
    live = tmp_path / f".s.yaml.{os.getppid()}.def{TEMP_SUFFIX}"
    old = tmp_path / f".s.yaml.{os.getppid()}.ghi{TEMP_SUFFIX}"
    other = (
        tmp_path / f".t.yaml.{dead.pid}.jkl{TEMP_SUFFIX}"
    )  # another file's, its writer killed: the folder's write cleans it
    other_live = tmp_path / f".t.yaml.{os.getppid()}.mno{TEMP_SUFFIX}"
    for path in (stale, live, old, other, other_live):
        path.write_text("partial")
    ancient = time.time() - 2 * files.STALE_AFTER_S
    os.utime(old, (ancient, ancient))
    write_atomic(target, "a: 1\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name, other_live.name])


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), KeyboardInterrupt()])
def test_a_failed_write_leaves_no_temporary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    target = tmp_path / "s.yaml"
    target.write_text("good\n")

    def fail(fd: int) -> None:
        raise failure

    monkeypatch.setattr(files.os, "fsync", fail)
    with pytest.raises(type(failure)):
        write_atomic(target, "new\n")
    monkeypatch.undo()
    assert target.read_text() == "good\n" and os.listdir(tmp_path) == ["s.yaml"]


SLOW_WRITE = """
import os, sys, time
from canzona.schedules import files
def slow_fsync(fd):
    print("writing", flush=True)
    time.sleep(60)
files.os.fsync = slow_fsync
from canzona.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("signum, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_during_the_write_removes_the_temporary(tmp_path: Path, signum: int, code: int) -> None:
    target = tmp_path / "s.yaml"
    target.write_text("good\n")
    # The command as a terminal starts it: a suite launched in the background (`cmd &` in a
    # script, nohup) hands its children SIGINT ignored, and Python then leaves it ignored.
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITE, *PLAN, "--force", "-o", str(target)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert process.stdout is not None
    assert process.stdout.readline() == "writing\n"  # the temporary file exists now
    assert any(p.name.endswith(TEMP_SUFFIX) for p in tmp_path.iterdir())
    process.send_signal(signum)
    _, err = process.communicate(timeout=60)
    assert process.returncode == code and err.strip() in ("canzona: terminated", "canzona: interrupted", "")
    assert "Traceback" not in err
    assert os.listdir(tmp_path) == ["s.yaml"] and target.read_text() == "good\n"


def test_readme_main_job_command_leaves_the_library_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`canzona plan --model qwen3-8b --tp 2 --dp 4` in a clone rewrites nothing."""
    library = tmp_path / "schedules" / "qwen3-8b"
    library.mkdir(parents=True)
    shipped = library_root() / "qwen3-8b" / "muon-tp2-dp4.yaml"
    shutil.copy(shipped, library)
    before = (library / shipped.name).stat()
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "--model", "qwen3-8b", "--tp", "2", "--dp", "4"]) == 0
    after = (library / shipped.name).stat()
    assert (library / shipped.name).read_bytes() == shipped.read_bytes()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sorted(os.listdir(library)) == [shipped.name]


@pytest.mark.slow
def test_every_library_schedule_replans_byte_identical(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["check", str(library_root())], capsys)
    assert code == 0, out
    assert all(line.startswith("fresh  ") for line in out.splitlines())


def test_render_refuses_a_folder_as_plan_and_calibrate_do(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "images"  # no suffix: once written as images.png beside the folder
    folder.mkdir()
    for command in (["render", "qwen3-8b/muon-tp2-dp4"], [*PLAN], ["calibrate", "--quick"]):
        code, out, err = run([*command, "-o", str(folder)], capsys)
        assert code == 2 and out == ""
        one_line_error(err, f"cannot write {str(folder)!r}: it is a folder")
    assert os.listdir(tmp_path) == ["images"] and os.listdir(folder) == []
