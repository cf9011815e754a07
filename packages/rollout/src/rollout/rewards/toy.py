"""Built-in toy tasks a tiny randomly initialised char-level model learns with GRPO on a CPU in minutes.

`repeat_char` (the trainer's default task): the prompt names one character at its end, e.g. "qk:7" names
"7" (a few random lowercase letters come first, so prompts differ). The target is the last prompt token,
so the first thing to learn is "repeat the previous character": a direct embedding -> logits path that a
2-layer model picks up in a few dozen GRPO steps; where to stop is harder (below). Targets default to "0123"
(`charset=` changes them; a policy stuck on one target scores 0.8 / len(charset), plus the bonus if it stops).
The ideal completion is the character `answer_len` times, then the stop token ("7777</s>").
    reward = (1 - stop_bonus) * (# of the first answer_len chars equal to the target) / answer_len
             + stop_bonus * [the completion stopped (finish_reason "stop") after exactly answer_len chars]
Partial credit per matching character gives GRPO a signal from the very first steps. The stop is harder: it
starts at ~1/128 of the probability, and early stops cost characters, so plain GRPO trains it away (< 1e-4)
before the characters are learnt and the reward ends at 0.8. A KL to the initial model keeps it sampled: the
trainer's default (`loss.kl_coef=0.2`) reaches 0.93-1.0 in 100 steps (three seeds measured).

`copy_digits`: the prompt ends with a digit string, e.g. "cp 3141:"; reward = share of positions of the
string reproduced in order, plus the same stop bonus for stopping right after it.

Prompts are split into train and held-out validation deterministically by a CRC32 of the prompt
string, so the two sets are disjoint whatever the seeds and sizes. Completions are compared as text;
trailing end-of-sequence markers that a decoder kept ("</s>", "<|im_end|>", ...) are ignored.
"""

from __future__ import annotations

import random
import string
import zlib
from typing import Any

END_MARKERS = ("</s>", "<|endoftext|>", "<|im_end|>", "<eos>", "<|eot_id|>")
NOISE = string.ascii_lowercase
VALIDATION_SHARE = 5  # one prompt in 5 is held out
# Four targets: measured robust (+0.3 held-out reward within ~20 GRPO steps for every seed tried).
# With all ten digits learning stalls at +0.3 for some seeds (one digit takes over several classes).
DEFAULT_CHARSET = "0123"


def strip_end_markers(text: str) -> str:
    """Remove end-of-sequence markers a decoder left at the end of `text`."""
    changed = True
    while changed:
        changed = False
        for marker in END_MARKERS:
            if text.endswith(marker):
                text, changed = text[: -len(marker)], True
    return text


def _split_of(prompt: str) -> str:
    return "validation" if zlib.crc32(prompt.encode()) % VALIDATION_SHARE == 0 else "train"


def _draw(make: Any, num: int, split: str, seed: int) -> list[dict[str, Any]]:
    if split not in ("train", "validation"):
        raise ValueError(f"toy prompts split={split!r}; choose 'train' or 'validation'")
    rng = random.Random(f"{seed}-{split}")
    out = []
    for _ in range(num * 1000):
        example = make(rng)
        if _split_of(example["prompt"]) == split:
            out.append(example)
            if len(out) == num:
                return out
    raise ValueError(f"could not draw {num} distinct-split toy prompts; widen the task (more noise or charset)")


def repeat_char_prompts(num: int, *, split: str = "train", seed: int = 0, charset: str = DEFAULT_CHARSET,
                        max_noise: int = 3) -> list[dict[str, Any]]:
    """`num` prompts {"prompt": "qk:7", "metadata": {"target": "7"}} of the given split."""
    if not charset:
        raise ValueError("repeat_char charset is empty; give at least one character")

    def make(rng: random.Random) -> dict[str, Any]:
        target = rng.choice(charset)
        noise = "".join(rng.choice(NOISE) for _ in range(rng.randint(1, max(1, max_noise))))
        return {"prompt": f"{noise}:{target}", "metadata": {"target": target}}

    return _draw(make, num, split, seed)


def _stop_bonus(text: str, length: int, stop_bonus: float, finish_reason: str | None) -> float:
    """`stop_bonus` for a completion that stopped after `length` characters. One cut at max_new_tokens never stopped,
    whatever its text: decoding drops special tokens, and a policy trained on the text's length alone learnt to pad
    its answer with <s> tokens instead of stopping ("222<s>2<s>" scored the bonus). Without a finish reason
    (a direct call), the text's length decides."""
    return stop_bonus if len(text) == length and finish_reason != "length" else 0.0


def repeat_char_reward(*, prompt: str, completion: str, metadata: dict[str, Any], answer_len: int = 4,
                       stop_bonus: float = 0.2, finish_reason: str | None = None, **_: Any) -> float:
    """Share of the first `answer_len` characters equal to the target, plus a bonus for stopping there."""
    target = metadata.get("target") or prompt.rstrip()[-1:]
    if not target:
        raise ValueError(f"repeat_char: no target in metadata and none parsable from prompt {prompt!r}")
    text = strip_end_markers(completion)
    hits = sum(ch == target for ch in text[:answer_len])
    return (1.0 - stop_bonus) * hits / answer_len + _stop_bonus(text, answer_len, stop_bonus, finish_reason)


def copy_digits_prompts(num: int, *, split: str = "train", seed: int = 0, length: int = 3) -> list[dict[str, Any]]:
    """`num` prompts {"prompt": "cp 314:", "metadata": {"target": "314"}} of the given split."""

    def make(rng: random.Random) -> dict[str, Any]:
        target = "".join(rng.choice(string.digits) for _ in range(length))
        return {"prompt": f"cp {target}:", "metadata": {"target": target}}

    return _draw(make, num, split, seed)


def copy_digits_reward(*, prompt: str, completion: str, metadata: dict[str, Any], stop_bonus: float = 0.2,
                       finish_reason: str | None = None, **_: Any) -> float:
    """Share of the target's positions reproduced, plus a bonus for stopping right after it."""
    target = str(metadata.get("target") or prompt.rstrip(":").split()[-1])
    text = strip_end_markers(completion)
    hits = sum(a == b for a, b in zip(text, target))
    return (1.0 - stop_bonus) * hits / len(target) + _stop_bonus(text, len(target), stop_bonus, finish_reason)


TOY_TASKS = {
    "repeat_char": (repeat_char_prompts, "rollout.rewards.toy:repeat_char_reward"),
    "copy_digits": (copy_digits_prompts, "rollout.rewards.toy:copy_digits_reward"),
}
