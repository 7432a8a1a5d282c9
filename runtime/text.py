"""Prompt cleaning and tokenization, as diffusers' WanPipeline does it (without transformers), and which of a bundle's
text programs a prompt's length runs: the shortest text encoder program that holds its tokens, and the
cross-attention keys and values of its first rows only (export/cross_kv.py's short programs)."""

from __future__ import annotations

import html
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ftfy
import numpy as np
import regex
from tokenizers import Tokenizer

from . import kinds
from . import manifest as mf
from .errors import UserError

log = logging.getLogger("runtime")


def check_prompt(prompt: str, what: str = "prompt") -> None:
    """Refuse an empty or blank prompt, as the server does (HTTP 400). diffusers would encode it as `</s>` alone and
    make an unconditional video, which guidance cannot steer toward anything: nearly always an unset variable or an
    empty form field, not a wish."""
    if not prompt.strip():
        raise UserError(f"{what} is empty: describe the video (an empty prompt makes an unconditional video, which "
                        "wan-aot refuses; see runtime/README.md)")


def clean(text: str) -> str:
    """ftfy, double html unescape, strip, collapse whitespace."""
    text = html.unescape(html.unescape(ftfy.fix_text(text))).strip()
    return regex.sub(r"\s+", " ", text).strip()


@dataclass
class PromptTokenizer:
    tokenizer: Tokenizer
    max_length: int

    @classmethod
    def from_file(cls, path: Path, max_length: int) -> PromptTokenizer:
        tok = Tokenizer.from_file(str(path))
        pad = tok.token_to_id("<pad>")
        tok.enable_truncation(max_length=max_length)
        tok.enable_padding(length=max_length, pad_id=0 if pad is None else pad, pad_token="<pad>")
        return cls(tok, max_length)

    def __call__(self, prompts: list[str], names: list[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask), both int32 (N, max_length); over-long prompts are truncated. With `names` (what each prompt
        is: "prompt", "negative prompt"), a warning for each truncated one, once per name: a run tokenizes its
        prompts more than once (to pick the programs first), and warns only where it encodes them."""
        encodings = self.tokenizer.encode_batch([clean(p) for p in prompts])
        warned = set()
        for p, enc, name in zip(prompts, encodings, names or []):
            if enc.overflowing and name not in warned:
                warned.add(name)
                log.warning("%s has %d tokens, more than the bundle's %d (its --max-sequence-length): truncated to its "
                            "first %d: %.60r...", name, self.count(p), self.max_length, len(enc.ids), p)
        ids = np.array([e.ids for e in encodings], dtype=np.int32)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int32)
        return ids, mask

    def count(self, prompt: str) -> int:
        """Tokens of `prompt` untruncated, special tokens included."""
        whole = Tokenizer.from_str(self.tokenizer.to_str())
        whole.no_truncation()
        whole.no_padding()
        return len(whole.encode(clean(prompt)).ids)


def prompt_rows(prompt: str | Sequence[str], batch: int, what: str) -> list[str]:
    """The `batch` prompts of a run: `prompt` repeated, or a list of `batch` strings; UserError otherwise. A prompt
    (`what` "prompt") may not be empty; a negative prompt may (diffusers' default)."""
    if isinstance(prompt, str):
        prompts = [prompt] * batch
    else:
        prompts = list(prompt) if isinstance(prompt, (list, tuple)) else []
        if len(prompts) != batch or not all(isinstance(p, str) for p in prompts):
            raise UserError(f"{what} must be a string or a list of {batch} strings (the bundle's batch size)")
    if what == "prompt":
        for p, name in zip(prompts, names(prompts, "prompt")):
            check_prompt(p, name)
    return prompts


def names(prompts: list[str], what: str) -> list[str]:
    """What each prompt of a batch is called in messages: `what`, or "`what` i of B" where they differ."""
    if len(set(prompts)) <= 1:
        return [what] * len(prompts)
    return [f"{what} {i + 1} of {len(prompts)}" for i in range(len(prompts))]


def encoder_length(m: mf.Manifest, tokens: int) -> int:
    """The shortest text encoder program of this bundle that holds `tokens` (kinds.text_lengths; bundles exported
    before those existed have only the full one)."""
    L = m.geometry.max_sequence_length
    have = [n for n in kinds.text_lengths(L) if kinds.text_encoder_program(n, L) in m.programs]
    return min((n for n in have if n >= tokens), default=L)


def used_rows(context: np.ndarray) -> int:
    """The rows of the (2B, L, D) embeddings `context` up to the last one that is not zero (NaN counts as used)."""
    used = np.flatnonzero(np.any(context != 0, axis=(0, 2)))
    return int(used[-1]) + 1 if used.size else 0


def short_rows(m: mf.Manifest, needed: int, programs: Sequence[str]) -> int | None:
    """The shortest T >= `needed` of this bundle's cross_kv_t<T> programs (CPU bundles; export/cross_kv.py) whose
    rows every program in `programs` runs with; None: all L (what diffusers computes)."""
    for t in kinds.short_text_lengths(m.geometry.max_sequence_length):
        if t >= needed and kinds.cross_kv_program(0, t) in m.programs and all(takes_rows(m, p, t) for p in programs):
            return t
    return None


def takes_rows(m: mf.Manifest, program: str, rows: int) -> bool:
    """Whether step program `program` runs with the keys and values of a prompt's first `rows` rows: a block loop
    that has the short blocks for them; a whole step taking `kv` takes all L rows (its input's shape)."""
    spec: Any = m.programs[program]
    if spec.blocks is not None:
        return str(rows) in spec.blocks.short_blocks
    return "kv" not in spec.inputs
