"""What `Pipeline.generate` (runtime/pipeline.py) checks before it hands a call to the kind's loop: the keywords only
some loops take (a bundle of another kind refuses them in one line) and the engine's keywords a loop does not take.
Both are made from the loops' settings table (runtime/loop_settings.py)."""

from __future__ import annotations

from typing import Any

from . import loop_settings
from .errors import UserError
from .kinds import Kind

# The keywords only some loops take (and what those loops are for), and the engine's keywords a loop does not take
# (given, refused in one line; None, dropped): both made from the loops' settings table (runtime/loop_settings.py).
LOOP_KEYWORDS: dict[str, tuple[str, tuple[str, ...]]] = loop_settings.LOOP_KEYWORDS
NOT_TAKEN: dict[str, tuple[str, ...]] = loop_settings.NOT_TAKEN


def check_keywords(kind: Kind, kwargs: dict[str, Any]) -> None:
    """Refuse, in one line, a keyword of another kind's loop given a value, or one of the engine's that the kind's
    loop does not take; drop those of the latter given as None (`kwargs` is changed in place)."""
    loop = kind.loop
    own = LOOP_KEYWORDS.get(loop, ("", ()))[1]
    for other, (what, names) in LOOP_KEYWORDS.items():
        given = [n for n in names if kwargs.get(n) is not None and n not in own]
        if other != loop and given:
            raise UserError(f"this bundle is {kind.title}: {given[0]} is for {what}")
    for name in NOT_TAKEN.get(loop, ()):
        if name in kwargs and kwargs.pop(name) is not None:
            raise UserError(f"this bundle is {kind.title}: it takes no {name.replace('_', ' ')}")
