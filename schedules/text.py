"""Text from a schedule file, made safe to print: the commands and the runtime's error messages
show a file's names through `printable`, so a file cannot move the cursor, clear the screen or
hide text on the terminal that shows them."""

from __future__ import annotations


def printable(text: str) -> str:
    """`text` with every character a terminal would not print as itself (control characters
    such as ESC, format characters such as bidirectional overrides, line separators) spelled as
    a Python escape, line breaks kept."""
    return "\n".join(
        line
        if line.isprintable()
        else "".join(char if char.isprintable() else char.encode("unicode_escape").decode("ascii") for char in line)
        for line in text.split("\n")
    )
