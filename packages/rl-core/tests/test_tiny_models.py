"""The tiny checkpoints' tokenizer, as every consumer loads it (AutoTokenizer from the saved directory)."""

from __future__ import annotations

import string

import pytest

from rl_core.testing.tiny_models import ARCHITECTURES, SPECIAL_TOKENS, save_tiny_checkpoint

TEXT = "Repeat the letter 'x' 3 times:\n\tthen stop? {ok}"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_saved_checkpoints_tokenizer_reads_every_printable_character(arch, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(save_tiny_checkpoint(tmp_path / arch, arch))
    # one id per character, in the order of string.printable after the special tokens: spaces, tabs and
    # newlines included (transformers reads a qwen2 checkpoint with its own Qwen2Tokenizer class)
    printable = [c for c in string.printable if c not in "\x0b\x0c\r"]
    expected = [len(SPECIAL_TOKENS) + printable.index(c) for c in TEXT]
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    assert ids == expected, type(tokenizer).__name__
    assert tokenizer.decode(ids, skip_special_tokens=True) == TEXT  # "?" is a character, not the unknown token
    assert len(tokenizer) == len(SPECIAL_TOKENS) + len(printable) + 1  # and <unk>
