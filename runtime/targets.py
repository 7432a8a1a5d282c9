"""Target presets: a platform plus a device mesh with axes (dp, sp, tp), created in that order.

The export traces every stage under the target's mesh and records it in the
manifest; the runtime rebuilds the same mesh from the devices it finds.
"""

from __future__ import annotations

from .errors import UserError
from .manifest import Target

AXES = ("dp", "sp", "tp")

PRESETS: dict[str, Target] = {
    "cpu": Target(name="cpu", platform="cpu", mesh={"dp": 1, "sp": 1, "tp": 1}),
}


def get(name: str) -> Target:
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown target {name!r}: choose one of {', '.join(PRESETS)}") from None
