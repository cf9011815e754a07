"""Reward of the `math` environment: correct when the completion's final answer equals the reference
answer under the `math-verify` library ("1/2", "0.5" and "\\frac{1}{2}" are equal; sets, intervals, LaTeX).

The answer is the last `\\boxed{...}` of the completion (brace-balanced); a last box left open (the
completion was cut off inside its final answer) scores 0; without a box, math-verify's own extraction
reads the whole completion, unless `require_boxed=True`, which scores that 0. The reference
answer comes from `metadata["answer"]`. Runs inside a reward worker subprocess, so it imports no torch;
math-verify's parser uses SIGALRM timeouts and sympy can hang on adversarial input: the pool's per-call
time limit bounds both.
"""

from __future__ import annotations

from typing import Any

# Imported at module level on purpose: a worker imports this module before it reports ready, so the
# slow sympy import does not eat into the first call's time limit.
from math_verify import parse, verify


def _last_box(text: str) -> tuple[str | None, bool]:
    """(content of the last `\\boxed{...}` / `\\fbox{...}` or None, whether that box is left open)."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None, False
    brace = text.find("{", start)
    if brace < 0:
        return None, False
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1:i], False
    return None, True  # unbalanced: the completion was cut off inside the box


def last_boxed_answer(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if absent or
    left open."""
    return _last_box(text)[0]


def math_reward(*, prompt: str, completion: str, metadata: dict[str, Any], require_boxed: bool = False,
                **_: Any) -> dict[str, Any]:
    """1.0 if the completion's answer equals metadata['answer'] under math-verify, else 0.0."""
    if "answer" not in metadata:
        raise KeyError(f"math environment: the prompt's metadata has no 'answer' (the reference answer; the "
                       f"dataset row's other fields are the metadata, found {sorted(metadata)}): name that "
                       "field 'answer' in the prompt file")
    gold = parse(str(metadata["answer"]))
    if not gold:
        gold = parse(f"${metadata['answer']}$")
    boxed, cut_off = _last_box(completion)
    if cut_off:  # the final answer never ended: an earlier box or number in the text is not the answer
        return {"reward": 0.0, "correct": False}
    if boxed is not None:
        answer = parse(f"${boxed}$")
    elif require_boxed:
        return {"reward": 0.0, "correct": False}
    else:
        answer = parse(completion)
    correct = bool(gold) and bool(answer) and bool(verify(gold, answer))
    return {"reward": float(correct), "correct": correct}
