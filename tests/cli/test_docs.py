"""The documentation the project owns (issue 17, items 6-8): nothing points outside the project,
every link resolves, CI runs exactly the README's commands, and those commands leave a fresh
clone's `git status` clean."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from canzona.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
SKIPPED_DIRS = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "out"}
# Built from parts so this file does not match itself.
OUTSIDE = re.compile("|".join([re.escape("../" + "shared"), "DES" + r"IGN(\.md|\s*§)", "§" + r"\s*\d"]))


def project_files() -> list[Path]:
    """Every file of the project as a clone has it (tracked and new, not ignored), or, outside
    a git checkout, every file below the root but build output and caches."""
    if shutil.which("git") and (ROOT / ".git").exists():
        listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=ROOT,
                                capture_output=True, check=True).stdout.decode().split("\0")
        return [ROOT / name for name in listed if name and (ROOT / name).is_file()]
    return [p for p in ROOT.rglob("*") if p.is_file() and not SKIPPED_DIRS & set(p.relative_to(ROOT).parts)
            and not any(part.endswith(".egg-info") for part in p.parts)]


def test_nothing_cites_background_the_user_does_not_have() -> None:
    hits = []
    for path in project_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # images and other binary files
        hits += [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {m.group(0)}"
                 for m in OUTSIDE.finditer(text)]
    assert hits == []


def test_the_docs_index_lists_every_page_and_every_link_resolves() -> None:
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "README.md":
            assert f"]({page.name})" in index, page.name
    for document in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", document.read_text(encoding="utf-8")):
            if "://" not in target:
                assert (document.parent / target).exists(), f"{document.name} links to missing {target}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/concepts.md" in readme and "docs/README.md" in readme


def readme_commands() -> list[str]:
    """The README's first shell block: the commands a new user runs, comments stripped."""
    block = re.search(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)
    assert block is not None
    return [line.split("#")[0].strip() for line in block.group(1).splitlines() if line.split("#")[0].strip()]


def test_ci_runs_exactly_the_readme_install_and_test_commands() -> None:
    install, tests, plan = readme_commands()
    assert install == 'pip install torch==2.13.0 -e ".[test]"' and tests == "python -m pytest -q"
    assert plan.startswith("canzona plan ")
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    assert install in ci and tests in ci


def test_package_metadata_takes_a_torch_range() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    requirements = re.findall(r'"(torch\b[^"]*)"', pyproject)
    assert len(requirements) == 2 and all(r == "torch>=2.6" for r in requirements), requirements  # runtime, test
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "torch==2.13.0" in readme and "CUDA" in readme


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs a git checkout")
def test_readme_main_job_leaves_a_fresh_clone_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The README's plan command (and its larger example) in a fresh clone of the committed
    project: the schedules they write are the checked-in bytes, so nothing shows as changed."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True, capture_output=True)
    monkeypatch.chdir(clone)
    plans = [readme_commands()[2], "canzona plan --model qwen3-32b --tp 8 --dp 32"]
    assert plans[1] in (ROOT / "README.md").read_text(encoding="utf-8")
    for command in plans:
        assert main(shlex.split(command)[1:]) == 0, capsys.readouterr().err
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True, check=True)
    assert status.stdout == ""


def test_readme_simulate_example_is_what_the_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("$ canzona simulate qwen3-32b/muon-tp8-dp32")[1].split("```")[0]
    shown = [line for line in block.splitlines()[2:] if line.strip()]
    assert len(shown) == 20  # both tables, headers included
    assert main(["simulate", "qwen3-32b/muon-tp8-dp32"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert all(line in printed for line in shown), [line for line in shown if line not in printed]
