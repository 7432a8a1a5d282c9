"""Both command lines explain themselves: every flag has help, every default is said, the examples in
`python -m export --help` keep their line breaks, and a missing argument is named alone. `python -m export`'s other
jobs are commands with parsers of their own; their old spellings (flags of the build) name the command."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import pytest

from export.__main__ import main as export_main
from export.__main__ import parser as export_parser
from export.commands import COMMANDS, OLD_SPELLINGS
from export.dtypes import choose_dtype, cpu_flags
from runtime.__main__ import parser as runtime_parser

from .conftest import run_cli


def _options(p: argparse.ArgumentParser, prog: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _options(sub, f"{prog} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield f"{prog} {'/'.join(action.option_strings) or action.dest}", action


OPTIONS = dict([*_options(export_parser(), "export"),
                *(o for name, (_, make, _) in COMMANDS.items() for o in _options(make(), f"export {name}")),
                *_options(runtime_parser(), "runtime")])


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
    at = next(i for i, line in enumerate(lines) if "export attach artifacts/14b-int8" in line)
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
    assert proc.stderr.strip() == (f"error: {missing} to export (or add weights to a bundle: python -m export attach "
                                   "BUNDLE --weights SOURCE)")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("args, missing", [
    (["generate", "BUNDLE", "--out", "OUT"], "--prompt is required"),
    (["encode", "BUNDLE", "--prompt", "a cat"], "--out is required"),
    (["generate"], "bundle, --prompt and --out are required"),
])
def test_runtime_names_only_what_is_missing(tmp_path: Path, args: list[str], missing: str) -> None:
    """One line, exit 2, as every other bad input: not the command's whole usage (generate's is 50 lines) first."""
    args = [str(tmp_path / "b") if a == "BUNDLE" else str(tmp_path / "v.mp4") if a == "OUT" else a for a in args]
    proc = run_cli("runtime", *args, check=False)
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, f"error: {missing}\n", "")
    assert not (tmp_path / "v.mp4").exists()


@pytest.mark.parametrize("command, usage", [("attach", "BUNDLE --weights SOURCE"), ("savedmodel", "BUNDLE --out DIR"),
                                            ("lora", "FILE --bundle BUNDLE --out ADAPTER")])
def test_each_command_has_its_own_help(capsys: pytest.CaptureFixture, command: str, usage: str) -> None:
    """`python -m export COMMAND --help` is that command's usage and flags only; the build's --help lists it."""
    with pytest.raises(SystemExit) as e:
        export_main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and text.startswith(f"usage: python -m export {command} "), text
    flags = {a.split("=")[0] for a in text.split() if a.startswith("--")}
    assert all(f in flags for f in usage.split() if f.startswith("--")), (usage, flags)
    assert "--model" not in flags and "--resolution" not in flags  # the build's
    assert f"  {command}  " in export_parser().format_help()


@pytest.mark.parametrize("argv", [["--attach-weights", "B", "--weights", "W"], ["--savedmodel=B", "--out", "O"],
                                  ["--model", "tiny", "--lora", "L", "--bundle", "B", "--out", "O"]],
                         ids=["attach-weights", "savedmodel", "lora"])
def test_an_old_spelling_names_its_command(capsys: pytest.CaptureFixture, tmp_path: Path, argv: list[str]) -> None:
    """The build's old job flags answer in one line, exit 2, with the command that does the job now."""
    flag = next(a.split("=")[0] for a in argv if a.split("=")[0] in OLD_SPELLINGS)
    assert export_main([str(tmp_path / a) if a in "BO" else a for a in argv]) == 2
    out, err = capsys.readouterr()
    assert not out and err == f"error: {flag} is now a command: {OLD_SPELLINGS[flag]}\n"
    assert f"python -m export {flag.removeprefix('--').removesuffix('-weights')} " in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, message", [
    (["lora", "L", "--bundle", "B"], "python -m export lora: the following arguments are required: --out"),
    (["savedmodel", "B", "--out", "O", "--weights", "W"], "python -m export savedmodel: unrecognized arguments: "
                                                          "--weights W"),
    (["attach", "B", "--weights", "W", "--validate"], "python -m export attach: unrecognized arguments: --validate"),
    (["--model", "tiny", "--validate"], None),  # the build's own parser: argparse's usage, then the line
])
def test_a_command_takes_only_its_own_flags(capsys: pytest.CaptureFixture, argv: list[str], message: str | None
                                            ) -> None:
    with pytest.raises(SystemExit) as e:
        export_main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    if message is not None:  # the commands' usage errors are one line
        assert err == f"error: {message} (see {message.split(':')[0]} --help)\n", err
    else:
        assert err.strip().endswith("error: unrecognized arguments: --validate"), err


@pytest.mark.parametrize("target, flags, dtype", [
    ("cpu", {"avx2", "amx_bf16", "amx_tile"}, "bf16"),  # AMX (Sapphire Rapids and later)
    ("cpu", {"avx2", "avx512f", "avx512_bf16"}, "bf16"),  # AVX512-BF16 (Cooper Lake, Zen 4)
    ("cpu", {"avx2", "avx512f", "fma"}, "fp32"),  # bf16 emulated: fp32 is faster there
    ("cpu", set(), "fp32"),
    ("tpu", set(), "bf16"),
    ("cuda", set(), "bf16"),
])
def test_dtype_auto_chooses_for_the_build_machines_cpu(target: str, flags: set[str], dtype: str) -> None:
    assert choose_dtype("auto", target, flags) == dtype
    assert choose_dtype("fp32", target, flags) == "fp32" and choose_dtype("bf16", target, flags) == "bf16"
    assert OPTIONS["export --dtype"].default == "bf16"  # auto is asked for, never the default


def test_cpu_flags_read_the_flags_line(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu sse2 avx2 amx_bf16\n\nprocessor\t: 1\n")
    assert cpu_flags(info) == {"fpu", "sse2", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "none") == frozenset()


def test_quiet_export_silences_jaxs_float64_truncation_warning() -> None:
    """SkyReels-V2's DiT asks torch for a float64 arange, which JAX without x64 truncates to float32 with a
    UserWarning on every export: `python -m export -q` printed it. The export's warning filters drop that one."""
    import os
    import warnings
    from unittest import mock

    import jax.numpy as jnp

    from export.__main__ import _quiet_build_libraries

    with warnings.catch_warnings(record=True) as caught, mock.patch.dict(os.environ):
        warnings.simplefilter("always")
        jnp.arange(4, dtype="float64")
        assert [w for w in caught if "float64" in str(w.message)], "JAX no longer warns: drop the filter"
        caught.clear()
        _quiet_build_libraries()
        jnp.arange(4, dtype="float64")
    assert not caught, [str(w.message) for w in caught]
