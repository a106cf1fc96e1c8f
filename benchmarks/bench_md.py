"""Writing a benchmark's table into BENCHMARKS.md: what every benchmark's `--write` shares.

A section is `## HEADING`, the command that measured it, then the generated table between two
markers. Re-running replaces only what lies between the markers, so the prose written around a
table (what it means, what changed) survives; a section without markers is replaced whole, and
a missing one appended.
"""

from __future__ import annotations

import re
from pathlib import Path

BEGIN, END = "<!-- generated: do not edit by hand -->", "<!-- end of generated -->"


def write_section(path: Path, heading: str, text: str, command: str) -> None:
    """Put `text` (measured by `command`) into the `heading` section of the file at `path`."""
    content = path.read_text()
    generated = f"{BEGIN}\nMeasured by `{command}`.\n\n{text}\n{END}"
    section = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    found = section.search(content)
    if found is None:
        content = content.rstrip("\n") + f"\n\n{heading}\n\n{generated}\n"
    elif BEGIN in found.group(0) and END in found.group(0):
        inner = re.compile(rf"{re.escape(BEGIN)}.*?{re.escape(END)}", re.S)
        content = content[: found.start()] + inner.sub(lambda _: generated, found.group(0)) + content[found.end() :]
    else:
        content = content[: found.start()] + f"{heading}\n\n{generated}\n\n" + content[found.end() :]
    path.write_text(content)
