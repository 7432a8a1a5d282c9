"""LoRA adapters per request (`runtime serve --lora-dir DIR`): the `lora` field, what /v1/models lists, which adapters
a tenant may use, and which queued job a replica takes next so that a mixed queue does not switch on every job.

The field is a list of `{"name", "scale"[, "expert"]}`: in a JSON body; in a multipart form as one field holding the
same JSON text; or as the openai SDK sends `extra_body={"lora": [...]}` in a form, grouped by key (every entry's
`lora[][name]`, then every entry's `lora[][scale]`), which are paired up in order here. `expert` ("high" | "low", on
two-expert bundles) needs a JSON form: a grouped part cannot say which entry it belongs to. Everything is checked
before the job is queued: the names against the adapters offered (and the tenant's), scales finite in [-4, 4], at
most --max-loras entries, an expert only where the bundle has two and the adapter fits it.

A job's set is carried in its params as it was asked (runtime/serve/run.py turns it into `Pipeline.use_loras`,
after the server's own `--lora` adapters); `set_key` names it. A replica prefers the queued job whose set is the one
its weights hold (`pick`), within the order the tenants' turns give (runtime/serve/jobs.py), and never lets a job be
passed over more than --lora-affinity-max times for it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..adapters import EXPERTS
from .errors import ApiError
from .jsonnum import number as json_number

MAX_LORAS = 4  # entries per request (`serve --max-loras`)
SCALE = (-4.0, 4.0)  # a scale's range: past it an adapter's change dwarfs the weights it changes
AFFINITY_MAX = 4  # how many other jobs a queued job may be passed over by for a set's sake (`--lora-affinity-max`)
FIELD = "lora"
_KEYS = ("name", "scale", "expert")
_GROUPED = re.compile(r"lora\[\]\[([A-Za-z0-9_]*)\]")


def api_experts(groups: Sequence[str], two_experts: bool) -> list[str]:
    """Weight groups as the API names them: `high` / `low` on a two-expert bundle, else the group (`transformer`)."""
    names = {g: e for e, g in EXPERTS.items()}
    return [names[g] if two_experts else g for g in groups]


def card(adapter: Any, two_experts: bool) -> dict[str, Any]:
    """An adapter as /v1/models lists it: name, rank, the experts it changes, the bundle tensors it changes."""
    return {"name": adapter.name, "rank": adapter.rank, "experts": api_experts(adapter.groups, two_experts),
            "tensors": adapter.tensors}


@dataclass
class Grouped:
    """The SDK's grouped form parts of `lora`, by key in the order sent (`lora[][name]` x n, `lora[][scale]` x n)."""

    parts: dict[str, list[str]] = field(default_factory=dict)

    def entries(self) -> list[dict[str, Any]]:
        if "expert" in self.parts:
            raise ApiError(400, "lora[][expert]: a form's grouped lora fields cannot say which entry an expert belongs "
                                "to: send lora as JSON (a JSON body, or one form field `lora` holding the JSON list)",
                           FIELD)
        other = sorted(set(self.parts) - {"name", "scale"})
        if other:
            raise ApiError(400, f"lora[][{other[0]}] is not a key of a lora entry (name, scale, expert)", FIELD)
        names, scales = self.parts.get("name", []), self.parts.get("scale")
        if scales is not None and len(scales) != len(names):
            raise ApiError(400, f"lora: {len(names)} lora[][name] fields but {len(scales)} lora[][scale]: give every "
                                "entry a scale (or none a scale, for 1)", FIELD)
        return [{"name": n, **({"scale": scales[i]} if scales is not None else {})} for i, n in enumerate(names)]


def form_part(name: str, value: Any, fields: dict[str, Any]) -> bool:
    """Take a multipart part of the SDK's grouped form of `lora` into `fields` (True), or leave it (False)."""
    if name == FIELD + "[]":  # what the SDK makes of a list of plain values: entries need a name and a scale
        raise ApiError(400, "lora must be a list of {\"name\", \"scale\"} objects, not of plain values", FIELD)
    m = _GROUPED.fullmatch(name)
    if m is None:
        return False
    if hasattr(value, "read"):
        raise ApiError(400, f"{name} must be text, not a file", FIELD)
    grouped = fields.setdefault(FIELD, Grouped())
    if not isinstance(grouped, Grouped):
        raise ApiError(400, "lora is sent twice (as a field and as lora[][...] fields)", FIELD)
    grouped.parts.setdefault(m.group(1), []).append(value)
    return True


def check(value: Any, offer: Any, form: bool) -> list[dict[str, Any]]:
    """The `lora` field, checked in full against the offer (schema.Offer): a list of {"name", "scale", "expert"} with
    the scale a float and the expert None where not given. ApiError(400) naming the field and the entry otherwise."""
    text = False
    if isinstance(value, Grouped):
        entries, text = value.entries(), True
    elif isinstance(value, str) and form and not value.strip():
        entries = []  # an empty form field (as a browser sends an input left empty): no adapter
    elif isinstance(value, str) and form:
        try:
            entries = json.loads(value)
        except (ValueError, RecursionError):
            raise ApiError(400, "lora in a form must be JSON text: a list of {\"name\", \"scale\"} objects, e.g. "
                                '[{"name": "style", "scale": 0.8}]', FIELD) from None
    else:
        entries = value
    if not isinstance(entries, list):
        raise ApiError(400, f"lora must be a list of {{\"name\", \"scale\"}} objects, got {value!r}"[:300], FIELD)
    if len(entries) > offer.max_loras:
        raise ApiError(400, f"lora has {len(entries)} entries; this server applies at most {offer.max_loras} "
                            "(--max-loras)", FIELD)
    offered = {a.name: a for a in offer.loras}
    two = offer.kind.experts > 1
    out = []
    for i, entry in enumerate(entries):
        where = f"lora[{i}]"
        if not isinstance(entry, dict):
            raise ApiError(400, f"{where} must be an object {{\"name\", \"scale\"}}, got {entry!r}"[:300], FIELD)
        unknown = sorted(set(entry) - set(_KEYS))
        if unknown:
            raise ApiError(400, f"{where}: {unknown[0]!r} is not a key of a lora entry (name, scale, expert)", FIELD)
        name = entry.get("name")
        if not isinstance(name, str) or name not in offered:
            names = ", ".join(sorted(offered))
            raise ApiError(400, f"{where}.name {name!r} is not an adapter this server offers: it offers {names} "
                                "(GET /v1/models lists them)", FIELD)
        scale = entry.get("scale", 1.0)
        number = json_number(scale, False, text)  # a form's numbers are text in JSON's number syntax
        lo, hi = SCALE
        if number is None or not math.isfinite(number) or not lo <= number <= hi:
            raise ApiError(400, f"{where}.scale must be a finite number in {lo:g}..{hi:g}, got {scale!r}", FIELD)
        expert = entry.get("expert")
        if expert is not None:
            if not two:
                raise ApiError(400, f"{where}.expert is for two-expert bundles; this one is {offer.kind.title} with "
                                    "one expert: leave expert out", FIELD)
            if expert not in EXPERTS:
                raise ApiError(400, f"{where}.expert must be one of {', '.join(EXPERTS)}, got {expert!r}", FIELD)
            if EXPERTS[expert] not in offered[name].targets:
                raise ApiError(400, f"{where}: adapter {name!r} does not fit the {expert} expert", FIELD)
        out.append({"name": name, "scale": float(number), "expert": expert})
    return out


def schema(offer: Any, form: bool, description: str) -> dict[str, Any]:
    """The field's JSON Schema: a list of entries; in a form, a string holding that list as JSON."""
    entry: dict[str, Any] = {
        "type": "object", "additionalProperties": False, "required": ["name"],
        "properties": {"name": {"type": "string", "enum": sorted(a.name for a in offer.loras)},
                       "scale": {"type": "number", "minimum": SCALE[0], "maximum": SCALE[1], "default": 1.0}}}
    if offer.kind.experts > 1:
        entry["properties"]["expert"] = {"type": "string", "enum": list(EXPERTS),
                                         "description": "the expert the adapter is applied to (default: the experts "
                                                        "it was made for)"}
    listed = {"type": "array", "items": entry, "maxItems": offer.max_loras}
    if form:
        return {"type": "string", "contentMediaType": "application/json", "contentSchema": listed,
                "description": description + " In a form: the list as JSON text, empty for none (the openai SDK's "
                                             "grouped lora[][name] and lora[][scale] fields are taken too)."}
    return {**listed, "description": description}


def set_key(entries: Sequence[dict[str, Any]] | None) -> str:
    """A job's set as text, the same for the same adapters, scales and experts in the same order."""
    return json.dumps([[e["name"], float(e["scale"]), e.get("expert")] for e in entries or []])


def specs(entries: Sequence[dict[str, Any]] | None) -> list[tuple[Any, ...]]:
    """A job's set as Pipeline.use_loras takes it: (name, scale[, expert])."""
    return [(e["name"], float(e["scale"]), *([e["expert"]] if e.get("expert") else [])) for e in entries or []]


def check_tenant(entries: Sequence[dict[str, Any]] | None, allowed: frozenset[str] | None) -> None:
    """ApiError(400) if the set names an adapter the tenant may not use (`allowed`: its names, None: any)."""
    if allowed is None:
        return
    for i, e in enumerate(entries or []):
        if e["name"] not in allowed:
            may = ", ".join(sorted(allowed)) or "none"
            raise ApiError(400, f"lora[{i}].name {e['name']!r}: your key may not use this adapter (it may use: "
                                f"{may})", FIELD)


def pick(rows: Sequence[tuple[str, int]], current: str, most: int) -> int:
    """Which of the queued jobs, in the order the tenants' turns give (`rows`: each one's set_key and how often it was
    passed over already), a replica whose weights hold set `current` takes: the first whose set is `current`, unless a
    job ahead of it was passed over `most` times already (then none behind that one may go first); else the first.
    The caller counts a pass for every job before the one taken."""
    for i, (key, passed) in enumerate(rows):
        if key == current:
            return i
        if passed >= most:
            break
    return 0
