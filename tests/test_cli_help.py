"""Both command lines explain themselves: every flag has help, every default is said, the examples in
`python -m export --help` keep their line breaks, and a missing argument is named alone."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from export.__main__ import parser as export_parser
from runtime.__main__ import parser as runtime_parser

from .conftest import run_cli


def _options(p: argparse.ArgumentParser, prog: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{prog} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield f"{prog} {'/'.join(action.option_strings) or action.dest}", action


OPTIONS = dict([*_options(export_parser(), "export"), *_options(runtime_parser(), "runtime")])


def test_every_flag_has_help_and_says_its_default() -> None:
    no_help = [flag for flag, action in OPTIONS.items() if not (action.help and action.help.strip())]
    unsaid = [f"{flag} (default {action.default!r})" for flag, action in OPTIONS.items()
              if action.option_strings and action.default not in (None, False, [], argparse.SUPPRESS)
              and "default" not in (action.help or "")]
    assert len(OPTIONS) > 100 and not no_help and not unsaid, (no_help, unsaid)


def test_guidance_says_the_bundle_decides() -> None:
    assert "(default: the bundle's)" in OPTIONS["runtime generate --guidance"].help


def test_export_examples_keep_their_line_breaks() -> None:
    """A backslash at the end of an example's line continues the shell command on the next line; in a plain (not raw)
    docstring Python joined the two lines."""
    lines = export_parser().format_help().splitlines()
    at = next(i for i, line in enumerate(lines) if "--attach-weights artifacts/14b-int8" in line)
    assert lines[at].endswith("\\") and lines[at + 1].strip().startswith("--dit-weights "), lines[at:at + 2]


@pytest.mark.parametrize("args, missing", [
    (["--out", "OUT"], "--resolution is required"),
    (["--resolution", "64x32"], "--out is required"),
    ([], "--resolution and --out are required"),
])
def test_export_names_only_what_is_missing(tmp_path: Path, args: list[str], missing: str) -> None:
    args = [str(tmp_path / "b") if a == "OUT" else a for a in args]
    proc = run_cli("export", "--model", "tiny", *args, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {missing} to export (or use --attach-weights BUNDLE --weights SOURCE)")
    assert not (tmp_path / "b").exists()
