"""Whether the installed jax can run programs that another jax exported.

jax.export promises six months of backward compatibility (old programs on a newer jax) and
three weeks forward (new programs on an older jax); the serialization format itself is
versioned and jax refuses what it cannot read. We check what can be checked exactly (the
format, through deserialization, and each program's calling convention against the range
this jax supports), refuse a bundle from a newer jax minor release (beyond the forward
window), and warn on any other version difference.
"""

from __future__ import annotations

import re
from typing import Any

import jax

from .errors import BundleError

PACKAGES = ("jax", "jaxlib")


def installed() -> dict[str, str]:
    import jaxlib

    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])


def check_versions(exported: dict[str, str]) -> list[str]:
    """Warnings for every difference; raises BundleError when the bundle's jax is a newer minor release."""
    have = installed()
    if "jax" not in exported:
        raise BundleError("the manifest records no exporting jax version: re-export the bundle")
    if _release(exported["jax"])[:2] > _release(have["jax"])[:2]:
        raise BundleError(f"bundle was exported with jax {exported['jax']}, newer than the installed jax {have['jax']} "
                          f"(jax.export is only forward compatible for weeks): install jax=={exported['jax']} "
                          f"jaxlib=={exported.get('jaxlib', exported['jax'])}, or re-export with jax {have['jax']}")
    return [f"bundle was exported with {name} {exported[name]}, this is {name} {have[name]}: it should run (within "
            f"jax.export's compatibility window) but outputs may differ slightly; re-export to match exactly"
            for name in PACKAGES if name in exported and exported[name] != have[name]]


def check_program(name: str, exp: Any, exported_jax: str | None) -> None:
    """Refuse a program whose calling convention this jax does not run."""
    lo = jax.export.minimum_supported_calling_convention_version
    hi = jax.export.maximum_supported_calling_convention_version
    v = exp.calling_convention_version
    if not lo <= v <= hi:
        raise BundleError(f"program {name} uses jax.export calling convention {v}, this jax ({jax.__version__}) runs "
                          f"{lo}..{hi}: re-export with this jax, or install the exporter's ({exported_jax})")
