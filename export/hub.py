"""A hub id that cannot be read, said in one line: why (no network, not in the offline cache, no such repo or
revision, a gated repo) and what to do.

diffusers and transformers wrap huggingface_hub's errors in their own (a 77-line chained traceback that ends in
"does not appear to have a file named model_index.json" when the machine is offline), so the cause is found by
walking the exception's chain for huggingface_hub's error types and the HTTP client's connection errors.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

from runtime.errors import UserError


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)


def _download_hint(repo: str, flag: str) -> str:
    return (f"on a machine with network, `hf download {repo} --local-dir DIR` (huggingface_hub's CLI), copy DIR "
            f"here and pass {flag} DIR")


def explain(exc: BaseException, repo: str, flag: str, revision: str | None = None) -> UserError | None:
    """The one-line error for `exc` raised while reading hub repo `repo` (given as `flag`), or None when nothing in
    its chain comes from the hub or the network."""
    try:
        from huggingface_hub import errors as hub
    except ModuleNotFoundError:  # no hub library, so no hub error (the missing extra is reported on its own)
        return None
    chain = list(_chain(exc))

    def found(*types: type) -> bool:
        return any(isinstance(e, types) for e in chain)

    names = {type(e).__name__ for e in chain}  # the HTTP client's (httpx, httpcore, requests) errors, by name
    unreachable = found(ConnectionError, TimeoutError, socket.gaierror) or bool(
        names & {"ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException", "NetworkError", "ProxyError"})
    offline = found(hub.OfflineModeIsEnabled) or (
        found(hub.LocalEntryNotFoundError) and os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes"))
    if found(hub.GatedRepoError):
        return UserError(f"{flag} {repo} is a gated repo: accept its terms on its hub page and log in "
                         "(`hf auth login` or HF_TOKEN), or pass a local copy as " + flag)
    if found(hub.RevisionNotFoundError):
        return UserError(f"{flag} {repo} has no revision {revision!r}: pass an existing branch, tag or commit as "
                         "--revision")
    if found(hub.RepositoryNotFoundError):
        return UserError(f"{flag} {repo}: no such hub repo (or a private one: log in with `hf auth login`); the Wan "
                         "checkpoints are Wan-AI/Wan2.1-T2V-1.3B-Diffusers and the others in the README's table")
    if offline:
        return UserError(f"{flag} {repo} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set, so the hub "
                         f"is not asked: {_download_hint(repo, flag)}, or `hf download {repo}` into this cache "
                         "(HF_HOME) first")
    if unreachable or found(hub.LocalEntryNotFoundError):
        return UserError(f"cannot reach the Hugging Face hub to read {flag} {repo}, and it is not in the local cache: "
                         f"{_download_hint(repo, flag)}, or set HF_HUB_OFFLINE=1 with the repo in the local Hugging "
                         "Face cache (HF_HOME)")
    if found(hub.RemoteEntryNotFoundError):
        return UserError(f"{flag} {repo} lacks a file a diffusers-format Wan pipeline has (model_index.json and one "
                         "folder per component): pass the `-Diffusers` repo of the model")
    if found(hub.HfHubHTTPError):
        error = next(e for e in chain if isinstance(e, hub.HfHubHTTPError))
        return UserError(f"the Hugging Face hub failed reading {flag} {repo}: {str(error).splitlines()[0]}")
    return None


@contextlib.contextmanager
def errors_explained(repo: str | None, flag: str, revision: str | None = None) -> Iterator[None]:
    """Within: an error from reading hub repo `repo` becomes a UserError that says why in one line; others pass.
    (The CLI sets HF_HUB_VERBOSITY=error, so that huggingface_hub's retry warnings don't precede that line.)"""
    try:
        yield
    except (UserError, ModuleNotFoundError):  # a missing extra is said by the CLI (runtime/extras.py)
        raise
    except Exception as e:
        error = explain(e, repo, flag, revision) if repo else None
        if error is None:
            raise
        raise error from None
