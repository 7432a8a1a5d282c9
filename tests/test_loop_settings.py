"""The loops' settings table (runtime/loop_settings.py) is the one declaration each loop's own settings have: the loops
take what it says, and the CLI's flags, the API's fields and generate's refusals are made from it."""

from __future__ import annotations

import argparse
import inspect
import re

import pytest

from runtime import front, kinds, loop_settings
from runtime.__main__ import parser
from runtime.errors import UserError
from runtime.pipeline import LOOPS
from runtime.serve.request_fields import BY_NAME as FIELDS

KIND_OF_LOOP = {"segment": "t2v", "animate": "animate", "forcing": "skyreels-df", "helios": "helios",
                "chronoedit": "chronoedit", "far": "anyflow-far", "animate-2": "animate-2"}


@pytest.mark.parametrize("loop", sorted(LOOPS))
def test_each_loop_takes_what_the_table_says(loop: str) -> None:
    params = inspect.signature(LOOPS[loop]).parameters
    takes = [s.name for s in loop_settings.SETTINGS if loop in s.loops]
    others = [n for other in loop_settings.LOOP_TITLES if other != loop for n in loop_settings.own(other)
              if loop not in loop_settings.BY_NAME[n].loops]
    assert [n for n in takes if n not in params] == [] and [n for n in others if n in params] == []
    assert kinds.get(KIND_OF_LOOP[loop]).loop == loop


def _generate_flags() -> dict[str, argparse.Action]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["generate"]
    return {a.dest: a for a in sub._actions}


@pytest.mark.parametrize("setting", [s for s in loop_settings.SETTINGS if s.flag or s.api], ids=lambda s: s.name)
def test_a_setting_is_its_flag_its_field_and_its_refusal(setting: loop_settings.Setting) -> None:
    flags = _generate_flags()
    if setting.flag is not None:
        action = flags[setting.name]
        assert (action.option_strings, action.help, action.default) == ([setting.option], setting.flag.help,
                                                                        setting.flag.default)
    if setting.api is not None:
        assert FIELDS[setting.name].description == setting.api.description
    elsewhere = next(loop for loop in KIND_OF_LOOP if loop not in setting.loops)
    kind = kinds.get(KIND_OF_LOOP[elsewhere])
    refusal = re.escape(f"this bundle is {kind.title}: ") + ".*" + setting.name.replace("_", ".")
    with pytest.raises(UserError, match=refusal):
        front.check_keywords(kind, {setting.name: 1})
