"""Which optional extra (pyproject.toml's [project.optional-dependencies]) brings a module, so that a command run
without it says the pip command in one line instead of raising ModuleNotFoundError.

`pip install 'wan-aot[EXTRA]'` works for any installed wan-aot, editable or not: pip takes the installed
distribution as the requirement's and installs only what the extra adds.
"""

from __future__ import annotations

from .errors import UserError

# extra: the modules it installs that wan-aot imports, each from a distribution the extra names or one that such a
# distribution requires (starlette comes with fastapi); tests/test_missing_extras.py checks that against pyproject.toml
MODULES: dict[str, tuple[str, ...]] = {
    "export": ("torch", "torchax", "diffusers", "transformers", "accelerate", "sentencepiece", "google.protobuf",
               "gguf"),
    "serve": ("fastapi", "starlette", "uvicorn", "prometheus_client", "python_multipart", "multipart"),
    "postgres": ("psycopg", "psycopg_pool"),
    "objectstore": ("fsspec", "s3fs"),
    "savedmodel": ("tensorflow", "orbax"),
    "tpu": ("libtpu",),
}


def pip_command(extra: str) -> str:
    return f"pip install 'wan-aot[{extra}]'"


def extra_of(module: str | None) -> str | None:
    """The extra that installs `module` (a dotted name; its package counts), or None."""
    for extra, names in MODULES.items():
        for name in names:
            if module is not None and (module == name or module.startswith(name + ".")):
                return extra
    return None


def missing(error: ModuleNotFoundError, command: str) -> UserError | None:
    """The one-line error for `command` (e.g. "python -m runtime serve") failing on a module an extra installs; None
    for any other missing module (a bug, not a missing install)."""
    extra = extra_of(error.name)
    if extra is None:
        return None
    return UserError(f"{command} needs the {extra} extra ({error.name} is not installed): {pip_command(extra)}")
