"""The README's table of `autotp serve`'s flags, made from the argparse definitions in autotp.cli.

    .venv/bin/python tests/readme_flags.py          # rewrite the table in README.md
    .venv/bin/python tests/readme_flags.py --check  # exit 1 if the README's table is not this one

tests/test_readme.py checks the table against this output and against `autotp serve --help`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autotp.cli import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"
BEGIN = "<!-- serve flags: made by tests/readme_flags.py from autotp.cli; edit there -->"
END = "<!-- end of serve flags -->"


def command_parser(command: str) -> argparse.ArgumentParser:
    """The parser of `autotp COMMAND`."""
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[command]


def serve_parser() -> argparse.ArgumentParser:
    return command_parser("serve")


def table() -> str:
    parser = serve_parser()
    formatter = parser._get_formatter()
    rows = ["| flag | what it sets |", "|---|---|"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        value = f" {action.metavar or action.dest.upper()}" if action.nargs != 0 else ""
        if action.choices and not action.metavar:
            value = " {" + ",".join(map(str, action.choices)) + "}"
        first, *aliases = action.option_strings
        names = f"`{first}{value}`" + "".join(f", `{alias}`" for alias in aliases)
        text = formatter._expand_help(action).replace("|", "\\|").replace("\n", " ")
        rows.append(f"| {names} | {text} |")
    return "\n".join(rows)


def section(readme: str) -> str:
    return readme[readme.index(BEGIN) + len(BEGIN):readme.index(END)].strip()


def main() -> int:
    readme = README.read_text()
    if "--check" in sys.argv:
        return 0 if section(readme) == table() else 1
    start, end = readme.index(BEGIN) + len(BEGIN), readme.index(END)
    README.write_text(readme[:start] + "\n" + table() + "\n" + readme[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
