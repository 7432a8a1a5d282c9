"""Prompt cleaning and tokenization, as diffusers' WanPipeline does it (without transformers)."""

from __future__ import annotations

import html
import logging
from dataclasses import dataclass
from pathlib import Path

import ftfy
import numpy as np
import regex
from tokenizers import Tokenizer

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
