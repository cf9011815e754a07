"""`reward_model`: the environment's batched, padded scores against a plain transformers forward of each text
alone (no padding, no batching); its refusals."""

from __future__ import annotations

import pytest
import torch

from rl_core.interfaces import RewardRequest
from rl_core.testing.tiny_models import save_tiny_reward_model
from rollout.environments import create_environment

TEXTS = [("qk:2", "2222"), ("ab:5", "5"), ("zz:3", "33333333 and more"), ("x", ""), ("hello:1", "11")]


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory) -> str:
    """A tiny Qwen2 sequence classifier with two outputs (`label` picks one), random weights."""
    return str(save_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", num_labels=2))


def plain_scores(model_dir: str, texts: list[str], label: int) -> list[float]:
    """Each text alone through transformers: the chosen logit at its last token."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [float(model(input_ids=tokenizer(text, return_tensors="pt")["input_ids"]).logits[0, label])
                for text in texts]


@pytest.mark.parametrize("label", [0, 1])
def test_batched_padded_scores_equal_each_text_alone(reward_model_dir, label):
    env = create_environment("reward_model", model=reward_model_dir, batch_size=2, label=label)
    results = env.score([RewardRequest(prompt=p, completion=c, metadata={}) for p, c in TEXTS])
    expected = plain_scores(reward_model_dir, [p + c for p, c in TEXTS], label)
    assert [r.reward for r in results] == pytest.approx(expected, abs=1e-5)
    assert len({round(r.reward, 4) for r in results}) == len(TEXTS)  # the completion changes the reward
    assert all(r.error is None and r.correct is None for r in results)


def test_a_reward_model_without_pad_token_id_still_batches(reward_model_dir, tmp_path):
    """transformers' pooling finds the last real token by config.pad_token_id (and refuses batches without one):
    the environment sets it from the tokenizer."""
    import json
    import shutil

    shutil.copytree(reward_model_dir, tmp_path / "rm")
    config = json.loads((tmp_path / "rm/config.json").read_text())
    config.pop("pad_token_id")
    (tmp_path / "rm/config.json").write_text(json.dumps(config))
    env = create_environment("reward_model", model=str(tmp_path / "rm"), batch_size=len(TEXTS))
    results = env.score([RewardRequest(prompt=p, completion=c, metadata={}) for p, c in TEXTS])
    assert [r.reward for r in results] == pytest.approx(plain_scores(reward_model_dir, [p + c for p, c in TEXTS], 0),
                                                        abs=1e-5)


def test_refusals_name_the_key(reward_model_dir, tmp_path):
    with pytest.raises(ValueError, match="env.kwargs.model=.*no config.json"):
        create_environment("reward_model", model=str(tmp_path))
    with pytest.raises(ValueError, match=r"env.kwargs.label=2: the reward model has 2 output\(s\)"):
        create_environment("reward_model", model=reward_model_dir, label=2)
    with pytest.raises(ValueError, match="env.kwargs.dtype='fp16' must be one of"):
        create_environment("reward_model", model=reward_model_dir, dtype="fp16")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no GPU.*env.num_workers=0"):
            create_environment("reward_model", model=reward_model_dir, device="cuda")


def test_chat_template_scores_the_conversation_in_the_reward_models_own_format(reward_model_dir, tmp_path):
    """With chat_template=true the reward model reads its own rendering of the prompt's messages plus the completion
    as the assistant's turn, not the policy's text: scores equal the hand-written conversations scored alone."""
    import shutil

    from transformers import AutoTokenizer

    rm = tmp_path / "rm"
    shutil.copytree(reward_model_dir, rm)
    tokenizer = AutoTokenizer.from_pretrained(rm)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'][0] }}> {{ m['content'] }}\n{% endfor %}"
    tokenizer.save_pretrained(rm)
    env = create_environment("reward_model", model=str(rm), batch_size=2, chat_template=True)
    system = {"role": "system", "content": "be brief"}
    requests = [RewardRequest(prompt=f"user: {p}\nassistant: ", completion=c,
                              messages=[system, {"role": "user", "content": p}]) for p, c in TEXTS]
    expected = plain_scores(reward_model_dir, [f"s> be brief\nu> {p}\na> {c}\n" for p, c in TEXTS], 0)
    assert [r.reward for r in env.score(requests)] == pytest.approx(expected, abs=1e-5)
    policy_text = plain_scores(reward_model_dir, [r.prompt + r.completion for r in requests], 0)
    assert all(abs(a - b) > 1e-4 for a, b in zip(expected, policy_text))  # the format matters to the score

    with pytest.raises(ValueError, match="needs the prompt as chat messages"):
        env.score([RewardRequest(prompt="p", completion="c")])
    tokenizer.chat_template = None
    tokenizer.save_pretrained(rm)
    (rm / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(ValueError, match="env.kwargs.chat_template=true, but the reward model's tokenizer .* has no "
                                         "chat template"):
        create_environment("reward_model", model=str(rm), chat_template=True)
