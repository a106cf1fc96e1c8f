"""`python -m canzona.cli` runs the `canzona` command."""

from canzona.cli.main import run

run()
