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

log = logging.getLogger("runtime")


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

    def __call__(self, prompts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(ids, mask), both int32 (N, max_length); over-long prompts are truncated with a warning."""
        encodings = self.tokenizer.encode_batch([clean(p) for p in prompts])
        for p, enc in zip(prompts, encodings):
            if enc.overflowing:
                log.warning("prompt longer than %d tokens was truncated: %.60r...", self.max_length, p)
        ids = np.array([e.ids for e in encodings], dtype=np.int32)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int32)
        return ids, mask
