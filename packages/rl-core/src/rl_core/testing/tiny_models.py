"""Tiny Hugging Face checkpoints of real architectures, built locally (nothing is downloaded).

Used by every package's tests, the benchmarks and the trainer's default run. A checkpoint is a normal HF
directory (config.json, model.safetensors, tokenizer files) that `AutoModelForCausalLM.from_pretrained`
loads. The tokenizer is character-level over printable ASCII, enough for the built-in toy tasks.
Needs `transformers` (the `rl-core[testing]` extra); imported lazily.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path
from typing import Any

import torch

from rl_core.checkpoint_io import atomic_dir

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe")
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
UNK_TOKEN = "<unk>"  # last in the vocabulary (after the characters); special tokens are dropped when decoding
# Part of every cache directory's name: bump it when what a cached checkpoint holds changes, so no old one is
# reused (2: the byte-level tokenizer, with its own unknown token; 3: a token for every id of the model).
CACHE_FORMAT = 3
VOCAB_SIZE = 128  # the tiny models' vocabulary; the tokenizer has a token for each of its ids
# head_dim 32: the smallest head size vLLM's CPU attention supports.
BASE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
# Gemma 2 (not in ARCHITECTURES: not every package supports it) with an attention logit soft-cap that binds:
# weights drawn wide, so raw attention scores reach several times the cap; what the soft-cap checks run on.
SOFTCAPPED_GEMMA2 = dict(head_dim=32, initializer_range=0.5, attn_logit_softcapping=2.0, final_logit_softcapping=None)


def _vocab() -> list[str]:
    """The special tokens, printable ASCII in its byte-level spelling (space is "Ġ", newline "Ċ"), the unknown,
    then "<extra_a>", "<extra_b>", ... up to VOCAB_SIZE.

    The extras are plain tokens that decode as their names (no digits in them, which a math reward would read):
    with no token behind ids 101..127 they decoded to nothing, and the default run's policy learnt to emit them
    where the reward counted characters (an invisible token made "11<id 120>11" the four characters "1111")."""
    from tokenizers import pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    chars = [byte_level.pre_tokenize_str(c)[0][0] for c in string.printable if c not in "\x0b\x0c\r"]
    named = [*SPECIAL_TOKENS, *chars, UNK_TOKEN]
    letters = string.ascii_lowercase
    extras = [f"<extra_{letters[i // 26 - 1] if i >= 26 else ''}{letters[i % 26]}>" for i in range(VOCAB_SIZE - len(named))]
    return [*named, *extras]


def build_tokenizer() -> Any:
    """A character-level `PreTrainedTokenizerFast` with <pad>, <s>, </s>, <unk> and a plain chat template.

    Byte-level like the real Qwen2/Llama-3 tokenizers, with no merges: transformers loads a qwen2 checkpoint's
    tokenizer as `Qwen2Tokenizer` whatever tokenizer_config.json names, and that class rebuilds a byte-level
    BPE from the vocabulary, in which a plain " " entry never matches (every space of a prompt was dropped). The
    unknown token is not a character: decoding drops special tokens, and with "?" as the unknown every real
    question mark was dropped with them.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(_vocab())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token=UNK_TOKEN
    )
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tok


def tiny_config(arch: str, vocab_size: int = VOCAB_SIZE, **overrides: Any) -> Any:
    """The HF config of a tiny model of architecture `arch` (one of ARCHITECTURES)."""
    import transformers

    classes = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "mixtral": transformers.MixtralConfig,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "gemma2": transformers.Gemma2Config,
    }
    if arch not in classes:
        raise ValueError(f"tiny model architecture {arch!r} is not known; choose one of {list(ARCHITECTURES)}")
    kwargs: dict[str, Any] = dict(BASE, vocab_size=vocab_size, tie_word_embeddings=False,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if arch == "qwen3":
        kwargs["head_dim"] = 32
    if arch in ("mixtral", "qwen3_moe"):
        kwargs.update(MOE)
    if arch == "qwen3_moe":
        kwargs.update(moe_intermediate_size=128, head_dim=32, norm_topk_prob=True)
    kwargs.update(overrides)
    return classes[arch](**kwargs)


def build_tiny_model(arch: str = "qwen2", *, seed: int = 0, dtype: torch.dtype = torch.float32,
                     **overrides: Any) -> Any:
    """A randomly initialised tiny `*ForCausalLM` (deterministic for a seed)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    # Larger-than-default init so that logits are far from uniform: tests then see real differences.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.08, generator=None)
            elif "bias" in name:
                param.normal_(0.0, 0.02)
    return model.eval()


def save_tiny_checkpoint(path: str | os.PathLike, arch: str = "qwen2", *, seed: int = 0,
                         max_shard_size: str | None = None, **overrides: Any) -> Path:
    """Build and save a tiny HF checkpoint with tokenizer at `path` (atomically); returns the path."""
    path = Path(path)
    model = build_tiny_model(arch, seed=seed, **overrides)
    tokenizer = build_tokenizer()
    with atomic_dir(path) as tmp:
        kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
        model.save_pretrained(tmp, **kwargs)
        tokenizer.save_pretrained(tmp)
        (tmp / "tiny_model.json").write_text(json.dumps({"arch": arch, "seed": seed, **overrides}))
    return path


def save_tiny_reward_model(path: str | os.PathLike, arch: str = "qwen2", *, seed: int = 0, num_labels: int = 1) -> Path:
    """A tiny `*ForSequenceClassification` (`num_labels` 1: a Bradley-Terry reward model) with random weights and
    the char tokenizer at `path` (atomically); returns the path."""
    from transformers import AutoModelForSequenceClassification

    path = Path(path)
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(
        tiny_config(arch, num_labels=num_labels, pad_token_id=tokenizer.pad_token_id))
    with atomic_dir(path) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return path


def cache_path(kind: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where locally built checkpoints of `kind` are cached: `<cache_dir>/<kind>-v<CACHE_FORMAT>`, by default
    under ~/.cache/rl-stack (the RL_STACK_CACHE environment variable moves it)."""
    root = Path(cache_dir or os.environ.get("RL_STACK_CACHE", Path.home() / ".cache" / "rl-stack"))
    return root / f"{kind}-v{CACHE_FORMAT}"


def cached_tiny_checkpoint(arch: str = "qwen2", *, seed: int = 0, cache_dir: str | os.PathLike | None = None,
                           **overrides: Any) -> Path:
    """A tiny checkpoint cached under `cache_path("tiny-models", cache_dir)`, built once."""
    root = cache_path("tiny-models", cache_dir)
    suffix = "-".join(f"{k}{v}" for k, v in sorted(overrides.items()))
    path = root / f"{arch}-s{seed}{'-' + suffix if suffix else ''}"
    if not (path / "config.json").exists():
        save_tiny_checkpoint(path, arch, seed=seed, **overrides)
    return path
