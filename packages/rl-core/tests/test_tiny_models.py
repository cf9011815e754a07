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
    assert tokenizer.convert_ids_to_tokens(len(SPECIAL_TOKENS) + len(printable)) == "<unk>"


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_id_the_model_can_sample_but_the_special_tokens_decodes_to_text(arch, tmp_path):
    """A sampled id that decodes to nothing is invisible to a reward that reads text: the default run's policy
    learnt to pad its answers with ids 101..127, which had no token, to earn repeat_char's length bonus."""
    from transformers import AutoConfig, AutoTokenizer

    path = save_tiny_checkpoint(tmp_path / arch, arch)
    tokenizer, vocab_size = AutoTokenizer.from_pretrained(path), AutoConfig.from_pretrained(path).vocab_size
    assert len(tokenizer) == vocab_size
    special = set(tokenizer.all_special_ids)
    assert special == {0, 1, 2, len(SPECIAL_TOKENS) + len(string.printable) - 3}  # <pad> <s> </s> <unk>
    silent = [i for i in range(vocab_size) if i not in special and not tokenizer.decode([i], skip_special_tokens=True)]
    assert silent == []
    assert not any(c.isdigit() for i in range(vocab_size) if i not in special  # a math reward would read them
                   for c in tokenizer.decode([i]) if len(tokenizer.decode([i])) > 1)
