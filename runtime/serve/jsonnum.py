"""A number in a request: a JSON number, or a form field's text in JSON's number syntax (a multipart form carries
every value as text). Read the same way by the create request's fields (fields.py) and the `lora` field's scales
(loras.py)."""

from __future__ import annotations

import re
from typing import Any

_INTEGER = re.compile(r"-?(0|[1-9][0-9]*)")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")


def number(value: Any, integer: bool, form: bool) -> float | int | None:
    """A JSON number (or a form field's text in JSON's number syntax) as int or float; None if it is not one, or
    not a whole number where an integer is asked for."""
    if form and isinstance(value, str):
        try:
            value = int(value) if _INTEGER.fullmatch(value) else float(value) if _NUMBER.fullmatch(value) else None
        except (ValueError, OverflowError):  # more digits than Python converts
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if integer and isinstance(value, float):
        return int(value) if value.is_integer() else None
    return value

