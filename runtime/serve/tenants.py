"""Tenants: who a request comes from, known by its API key.

`serve --api-keys FILE` reads one `KEY NAME` a line (blank lines and `#` comments aside), or `KEY NAME loras=A,B` for a
tenant that may use only those LoRA adapters of the server's `--lora-dir` (`loras=` alone: none; every line of one
tenant says the same); `--api-key KEY` (or WAN_AOT_API_KEY) is one more key, of the tenant named `default`. A tenant may
have several keys (a new one beside the old while clients move over). A video belongs to the tenant whose key created
it: the API shows each tenant only its own (runtime/serve/routes.py), the queue takes turns between tenants
(runtime/serve/jobs.py), and /metrics counts jobs per tenant name. The name is what the server records and reports; a
key is never logged, stored or echoed.

A key is checked against every key the server has, in constant time (the sha256 of each, compared with
hmac.compare_digest, none skipped), so the answer's timing says nothing about how much of a key was right. The file
is read again on SIGHUP (server.py): a key taken out of it stops working at once, without a restart; a file that
no longer reads keeps the keys the server had, with one line in the log.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError

DEFAULT_TENANT = "default"  # the tenant of `--api-key`, of a server without keys, and of jobs from before tenants
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_KEY = re.compile(r"[\x21-\x7e]+")  # what a bearer token in a header can hold: visible ASCII, no spaces


def check_key(key: str, where: str) -> str:
    """A key as given on the command line or in the environment, without the whitespace around it (a Kubernetes
    secret mounted as a file or an environment variable usually ends in a newline, which no client sends)."""
    key = key.strip()
    if not key:
        raise UserError(f"{where} is empty: give a key, or leave it out to serve without one")
    if not _KEY.fullmatch(key):
        raise UserError(f"{where} holds spaces or characters a client cannot send in an Authorization header: use "
                        "visible ASCII only (e.g. `openssl rand -hex 24`)")
    return key


LORAS = "loras="  # a line's third word: the LoRA adapters its tenant may use


def parse_keys(text: str, where: str, lora_names: frozenset[str] | None = None) -> dict[str, str]:
    """`KEY NAME` lines to {key: tenant name}. Errors name the line, never the key on it."""
    return parse_entries(text, where, lora_names)[0]


def parse_entries(text: str, where: str, lora_names: frozenset[str] | None = None
                  ) -> tuple[dict[str, str], dict[str, frozenset[str] | None]]:
    """`KEY NAME [loras=A,B]` lines to ({key: tenant name}, {tenant name: the adapters it may use, None: any}).
    `lora_names`: the adapters the server offers (None: none is checked). Errors name the line, never the key."""
    keys: dict[str, str] = {}
    lines: dict[str, int] = {}
    allowed: dict[str, tuple[frozenset[str] | None, int]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) not in (2, 3) or (len(words) == 3 and not words[2].startswith(LORAS)):
            also = " (a third word may only be loras=A,B: the LoRA adapters the tenant may use)" * (len(words) == 3)
            raise UserError(f"{where} line {number}: expected `KEY NAME` (two words), found {len(words)}{also}")
        key, name = words[:2]
        mine = None
        if len(words) == 3:
            mine = frozenset(n for n in words[2][len(LORAS):].split(",") if n)
            unknown = sorted(mine - lora_names) if lora_names is not None else []
            if unknown:
                offered = ", ".join(sorted(lora_names or ())) or "none (no --lora-dir)"
                raise UserError(f"{where} line {number}: LoRA adapter {unknown[0]!r} is not one the server offers "
                                f"({offered})")
        if name in allowed and allowed[name][0] != mine:
            raise UserError(f"{where} line {number}: tenant {name[:80]!r} may use other LoRA adapters than on line "
                            f"{allowed[name][1]}: give every line of a tenant the same loras= (or none)")
        allowed.setdefault(name, (mine, number))
        if not _KEY.fullmatch(key):
            raise UserError(f"{where} line {number}: the key holds characters a client cannot send in an "
                            "Authorization header: use visible ASCII only")
        if not _NAME.fullmatch(name):
            raise UserError(f"{where} line {number}: tenant name {name[:80]!r} must be 1-64 letters, digits, '_', '.' "
                            "or '-', starting with a letter or digit")
        if key in keys:
            raise UserError(f"{where} line {number}: the same key as line {lines[key]}: give each key once")
        keys[key], lines[key] = name, number
    return keys, {name: mine for name, (mine, _) in allowed.items()}


@dataclass
class Keys:
    """The keys the server takes, each to its tenant's name; safe to read from any thread while reloaded."""

    file: Path | None = None  # --api-keys FILE, read again by reload()
    single: str | None = None  # --api-key KEY: the `default` tenant
    lora_names: frozenset[str] | None = None  # the LoRA adapters the server offers: what `loras=` may name
    _table: tuple[tuple[bytes, str], ...] = field(default=(), repr=False)  # (sha256 of a key, tenant)
    _allowed: dict[str, frozenset[str] | None] = field(default_factory=dict, repr=False)  # tenant -> its adapters
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def load(cls, file: Path | None, single: str | None, lora_names: frozenset[str] | None = None) -> Keys | None:
        """The server's keys from `--api-keys FILE` and `--api-key KEY`; None when it has neither (no key asked).
        `lora_names`: the adapters the server offers, which the file's `loras=` may name."""
        if file is None and single is None:
            return None
        keys = cls(file=file, single=check_key(single, "--api-key (or WAN_AOT_API_KEY)") if single is not None
                   else None, lora_names=lora_names)
        keys.reload()
        return keys

    def reload(self) -> dict[str, int]:
        """Read the file again; the new keys replace the old in one step. Returns the keys per tenant name; raises
        UserError (the old keys stay) when the file cannot be read or is not well formed."""
        table: dict[str, str] = {}
        allowed: dict[str, frozenset[str] | None] = {}
        if self.file is not None:
            try:
                text = self.file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise UserError(f"--api-keys {self.file}: cannot read it ({getattr(e, 'strerror', None) or e})") \
                    from None
            table, allowed = parse_entries(text, f"--api-keys {self.file}", self.lora_names)
            if not table and self.single is None:
                raise UserError(f"--api-keys {self.file} has no `KEY NAME` line: no client could be let in")
        if self.single is not None:
            table.setdefault(self.single, DEFAULT_TENANT)
        with self._lock:
            self._table = tuple((hashlib.sha256(k.encode()).digest(), name) for k, name in table.items())
            self._allowed = allowed
        per_tenant: dict[str, int] = {}
        for name in table.values():
            per_tenant[name] = per_tenant.get(name, 0) + 1
        return per_tenant

    def loras(self, tenant: str) -> frozenset[str] | None:
        """The LoRA adapters `tenant` may use (its lines' `loras=`), None: any."""
        return self._allowed.get(tenant)

    def tenant(self, given: str) -> str | None:
        """The tenant whose key this is, or None. Every key is compared, in constant time, whatever matches."""
        digest = hashlib.sha256(given.encode("utf-8", "surrogateescape")).digest()
        found = None
        for known, name in self._table:
            if hmac.compare_digest(known, digest):
                found = name
        return found
