"""The documentation the project owns (issue 17, items 6-8; issue 25): nothing points outside
the project, every link and heading anchor resolves, CI runs exactly the README's commands, and
those commands leave a fresh clone's `git status` clean; the README stays short, its figures
are what the simulator prints, and its training script runs as written."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
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
        listed = (
            subprocess.run(
                ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
                cwd=ROOT,
                capture_output=True,
                check=True,
            )
            .stdout.decode()
            .split("\0")
        )
        return [ROOT / name for name in listed if name and (ROOT / name).is_file()]
    return [
        p
        for p in ROOT.rglob("*")
        if p.is_file()
        and not SKIPPED_DIRS & set(p.relative_to(ROOT).parts)
        and not any(part.endswith(".egg-info") for part in p.parts)
    ]


def test_nothing_cites_background_the_user_does_not_have() -> None:
    hits = []
    for path in project_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # images and other binary files
        hits += [
            f"{path.relative_to(ROOT)}:{text[: m.start()].count(chr(10)) + 1}: {m.group(0)}"
            for m in OUTSIDE.finditer(text)
        ]
    assert hits == []


def heading_anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated heading numbered from -1 (headings inside code blocks do not count)."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in re.findall(r"^#{1,6}\s+(.*?)\s*$", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_heading_anchors_follow_github() -> None:
    page = (
        "# The runtime: `CanzonaOptimizer`\n## What α means\n## Free order (`--order free`, the default)\n"
        "## Notes\n## Notes\n```python\n# a comment, not a heading\n```\n"
    )
    assert heading_anchors(page) == {
        "the-runtime-canzonaoptimizer",
        "what-α-means",
        "free-order---order-free-the-default",
        "notes",
        "notes-1",
    }


def test_the_docs_index_lists_every_page_and_every_link_resolves() -> None:
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name != "README.md":
            assert f"]({page.name})" in index, page.name
    for document in [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", document.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            linked = document.parent / target if target else document
            assert linked.exists(), f"{document.name} links to missing {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in heading_anchors(linked.read_text(encoding="utf-8")), (
                    f"{document.name} links to {target or document.name}#{anchor}, which has no such heading"
                )
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/concepts.md" in readme and "docs/README.md" in readme


def test_the_readme_stays_short_and_links_every_page() -> None:
    """The README onboards (what and why, install, the commands, a training script, links);
    the reference lives in docs/, and every page of it is one link away."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 150
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{page.name}" in readme, page.name


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
def test_readme_main_job_leaves_a_fresh_clone_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
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


def test_simulate_example_is_what_the_command_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/simulation.md shows both of `simulate`'s tables for the library's 256-GPU schedule,
    and the README quotes two of its figures: all of them are what the command prints now."""
    page = (ROOT / "docs" / "simulation.md").read_text(encoding="utf-8")
    block = page.split("$ canzona simulate qwen3-32b/muon-tp8-dp32")[1].split("```")[0]
    shown = [line for line in block.splitlines()[2:] if line.strip()]
    assert len(shown) == 20  # both tables, headers included
    assert main(["simulate", "qwen3-32b/muon-tp8-dp32"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert all(line in printed for line in shown), [line for line in shown if line not in printed]
    start = printed.index("optimizer step (nothing overlapped):") + 2
    table = printed[start : printed.index("", start)]
    step = {line.split()[0]: float(line.split()[1]) for line in table}
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"canzona's Muon step at {step['canzona']:.2f} s, against {step['zero1-gather']:.2f} s for ZeRO-1" in readme


def readme_training_script() -> tuple[str, list[str]]:
    """The README's training script (its one python block) and the commands after it that plan
    and launch it."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert len(blocks) == 1
    after = readme.split(blocks[0])[1]
    console = re.search(r"```console\n(.*?)```", after, re.S)
    assert console is not None
    return blocks[0], [
        line.removeprefix("$ ").strip() for line in console.group(1).splitlines() if line.startswith("$ ")
    ]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_readme_training_script_runs_as_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's script, saved as train.py, planned and launched with the README's two
    commands, word for word (torchrun on gloo here): every rank trains, and the loss, about 1
    at the start (E[x²] of the untrained autoencoder's target), falls well below it."""
    script, commands = readme_training_script()
    (tmp_path / "train.py").write_text(script, encoding="utf-8")
    plan, launch = commands
    assert plan.startswith("canzona plan --model py:train.py:make_model") and launch.startswith("torchrun ")
    monkeypatch.chdir(tmp_path)
    assert main(shlex.split(plan)[1:]) == 0, capsys.readouterr().err
    torchrun = Path(sys.executable).with_name("torchrun")
    result = subprocess.run(
        [str(torchrun), *shlex.split(launch)[1:]],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=200,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    losses = {int(rank): float(loss) for rank, loss in re.findall(r"rank (\d+): loss ([\d.]+)", result.stdout)}
    processes = int(shlex.split(launch)[shlex.split(launch).index("--nproc-per-node") + 1])
    assert sorted(losses) == list(range(processes)), result.stdout
    assert all(loss < 0.1 for loss in losses.values()), losses
