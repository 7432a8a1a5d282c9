"""Prompt cleaning and tokenization match diffusers + transformers."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.text import PromptTokenizer, clean

PROMPTS = [
    "A cat &amp;amp; a dog   baking\n a cake",
    "  ümlauts, “quotes” and émojis 🐈 ",
    "",
    "word " * 80,  # longer than the max length: truncated, eos kept
]


def test_clean_matches_diffusers() -> None:
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    for p in PROMPTS:
        assert clean(p) == prompt_clean(p)


@pytest.mark.parametrize("max_length", [8, 32])
def test_ids_match_transformers(checkpoints, tmp_path, max_length: int) -> None:
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean
    from transformers import AutoTokenizer

    from export.source import _tokenizer_json

    ref = AutoTokenizer.from_pretrained(str(checkpoints["tiny"] / "tokenizer"))
    path = tmp_path / "tokenizer.json"
    path.write_text(_tokenizer_json(ref))
    ours = PromptTokenizer.from_file(path, max_length)
    ids, mask = ours(PROMPTS)
    want = ref([prompt_clean(p) for p in PROMPTS], padding="max_length", max_length=max_length, truncation=True,
               add_special_tokens=True, return_attention_mask=True, return_tensors="np")
    np.testing.assert_array_equal(ids, want.input_ids)
    np.testing.assert_array_equal(mask, want.attention_mask)
    assert ids.dtype == np.int32 and ids.shape == (len(PROMPTS), max_length)
