"""One rank: engine logprobs equal a plain HF forward + log_softmax, for every supported architecture."""

from __future__ import annotations

import pytest
import torch

from engine_dtensor.engine import DTensorEngine
from engine_dtensor.testing import VOCAB, grpo_batch, hf_reference_logprobs, make_policy, max_abs_diff
from rl_core.losses import ClippedPGLoss
from rl_core.testing.contracts import random_token_batch
from rl_core.testing.distributed import run_distributed

LENGTHS = [5, 9, 7, 12]


def _engine_logprobs(rank: int, world: int, path: str, overrides: dict) -> list[torch.Tensor]:
    engine = DTensorEngine(make_policy(path, **overrides))
    return engine.compute_logprobs(random_token_batch(VOCAB, LENGTHS))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe"])
def test_one_sequence_per_forward_matches_hf(ckpt, arch: str) -> None:
    """Same shapes as the reference (one sequence per forward): only kernel rounding may differ."""
    (got,) = run_distributed(_engine_logprobs, 1, args=(ckpt(arch), {"logprob_batch_size": 1}))
    ref = hf_reference_logprobs(ckpt(arch), random_token_batch(VOCAB, LENGTHS).input_ids)
    diff = max_abs_diff(got, ref)
    print(f"{arch}: max|engine - HF| = {diff:.2e}")
    assert all(lp.dtype == torch.float32 and lp.device.type == "cpu" for lp in got)
    assert diff <= 1e-6


def test_temperature_divides_logits(ckpt) -> None:
    (got,) = run_distributed(
        _engine_logprobs, 1, args=(ckpt("qwen2"), {"logprob_batch_size": 1, "temperature": 0.7})
    )
    ref = hf_reference_logprobs(ckpt("qwen2"), random_token_batch(VOCAB, LENGTHS).input_ids, temperature=0.7)
    assert max_abs_diff(got, ref) <= 1e-6


def _truncated_logprobs(rank: int, world: int, path: str) -> list[torch.Tensor]:
    engine = DTensorEngine(make_policy(path, temperature=0.8, top_k=40, top_p=0.7, logprob_chunk_tokens=7,
                                       dtensor_cfg={"tensor_parallel_size": world}))
    return engine.compute_logprobs(random_token_batch(VOCAB, LENGTHS))


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_top_k_top_p_logprobs_are_of_the_truncated_distribution(ckpt, world: int) -> None:
    """policy.top_k / top_p: the log-softmax over the tokens the sampler keeps (float64 HF reference from the
    definition), vocab-parallel under TP=2; the full-vocabulary logprobs differ (the test can tell)."""
    got = run_distributed(_truncated_logprobs, world, args=(ckpt("qwen2"),))[0]
    seqs = random_token_batch(VOCAB, LENGTHS).input_ids
    ref = hf_reference_logprobs(ckpt("qwen2"), seqs, temperature=0.8, top_k=40, top_p=0.7)
    assert max_abs_diff(got, ref) <= 2e-6
    assert max_abs_diff(got, hf_reference_logprobs(ckpt("qwen2"), seqs, temperature=0.8)) > 0.1


def test_padded_batch_matches_hf_padded_batch(ckpt) -> None:
    """A right-padded micro-batch of 4 equals HF's own forward of the same padded batch (HF 2-D mask)."""
    from transformers import AutoModelForCausalLM

    (got,) = run_distributed(_engine_logprobs, 1, args=(ckpt("llama"), {"logprob_batch_size": 4}))
    seqs = random_token_batch(VOCAB, LENGTHS).input_ids
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True)
    mask = (torch.arange(ids.shape[1])[None] < torch.tensor(LENGTHS)[:, None]).long()
    model = AutoModelForCausalLM.from_pretrained(ckpt("llama"), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
    next_lp = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    ref = [torch.cat([torch.zeros(1), next_lp[i, : n - 1]]) for i, n in enumerate(LENGTHS)]
    diff = max_abs_diff(got, ref)
    print(f"padded batch: max|engine - HF| = {diff:.2e}")
    assert diff <= 1e-6


def _entropy_metric(rank: int, world: int, path: str, batch) -> float:
    engine = DTensorEngine(make_policy(path, temperature=0.8, dtensor_cfg={"tensor_parallel_size": world}))
    return engine.forward_backward(batch, ClippedPGLoss(), forward_only=True).metrics["entropy"]


@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.distributed)])
def test_entropy_metric_matches_hf(ckpt, world: int) -> None:
    """LossInputs.entropy[t] is the entropy of p(. | <t) at temperature T (vocab-parallel under TP=2)."""
    from transformers import AutoModelForCausalLM

    batch = grpo_batch(ckpt("llama"), lengths=[5, 9, 7, 12])
    got = run_distributed(_entropy_metric, world, args=(ckpt("llama"), batch))[0]
    model = AutoModelForCausalLM.from_pretrained(ckpt("llama"), dtype=torch.float32).eval()
    total = 0.0
    with torch.no_grad():
        for ids, mask in zip(batch.input_ids, batch.loss_mask):
            logp = torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1].double() / 0.8, -1)
            entropy = -(logp.exp() * logp).sum(-1)  # float64 reference
            total += float((entropy * mask[1:].double()).sum())  # entropy[t] belongs to token t + 1
    assert got == pytest.approx(total / batch.num_valid_tokens(), rel=1e-6)


@pytest.fixture(scope="module")
def softcapped(tmp_path_factory) -> str:
    from rl_core.testing.tiny_models import SOFTCAPPED_GEMMA2, save_tiny_checkpoint

    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("m") / "gemma2", "gemma2", vocab_size=VOCAB,
                                    **SOFTCAPPED_GEMMA2))


def test_attention_softcap_is_applied(softcapped) -> None:
    """sdpa and the packed kernels ignore Gemma 2's attention soft-cap: `auto` takes eager for such a model
    (before: sdpa_segments, logprobs off HF's eager forward), and naming another is an error."""
    from transformers import AutoModelForCausalLM

    from engine_dtensor.engine import resolve_attn_implementation

    (got,) = run_distributed(_engine_logprobs, 1, args=(softcapped, {"logprob_batch_size": 1}))
    model = AutoModelForCausalLM.from_pretrained(softcapped, dtype=torch.float32, attn_implementation="eager")
    uncapped = AutoModelForCausalLM.from_pretrained(softcapped, dtype=torch.float32, attn_implementation="sdpa")
    refs = []
    for hf in (model, uncapped):
        with torch.no_grad():
            refs.append([torch.cat([torch.zeros(1), torch.log_softmax(hf(input_ids=ids[None]).logits[0, :-1], -1)
                                    .gather(-1, ids[1:, None])[:, 0]]) for ids in random_token_batch(VOCAB, LENGTHS).input_ids])
    assert max_abs_diff(got, refs[0]) <= 1e-5 < 1e-2 < max_abs_diff(refs[0], refs[1])  # the cap matters here
    with pytest.raises(ValueError, match=r"attn_implementation='sdpa_segments' ignores the model's attention logit"):
        resolve_attn_implementation("sdpa_segments", torch.device("cpu"), "float32", softcap=2.0)


def _training_forward(rank: int, world: int, path: str, hf_dir: str) -> list[list[torch.Tensor]]:
    """Per micro-batch, the per-sequence logprobs the loss sees in a training forward (model.train()); and the
    engine's save_hf at `hf_dir`."""
    engine = DTensorEngine(make_policy(path, train_micro_batch_size=4))
    seen: list[list[torch.Tensor]] = []

    def loss_fn(inputs):
        counts = torch.bincount(inputs.seq_ids).tolist()
        seen.append([lp.detach().clone() for lp in inputs.logprobs.split(counts)])
        return inputs.logprobs.sum() * 0.0, {}

    engine.forward_backward(random_token_batch(VOCAB, LENGTHS), loss_fn)
    engine.save_hf(hf_dir)
    return seen


def test_a_checkpoints_dropout_is_off_in_training_and_kept_in_save_hf(tmp_path) -> None:
    """A checkpoint with attention_dropout=0.5: the training forward's logprobs equal HF's eval-mode forward
    (dropout on, they differ by far more than rounding), and the saved config.json still says 0.5."""
    import json

    from rl_core.testing.tiny_models import save_tiny_checkpoint

    path = str(save_tiny_checkpoint(tmp_path / "dropout", "qwen2", seed=2, attention_dropout=0.5))
    (seen,) = run_distributed(_training_forward, 1, args=(path, str(tmp_path / "hf")))
    ref = hf_reference_logprobs(path, random_token_batch(VOCAB, LENGTHS).input_ids)
    by_length = {len(lp): lp for micro in seen for lp in micro}  # the lengths differ: they name the sequences
    assert max_abs_diff([by_length[len(lp)] for lp in ref], ref) <= 1e-5
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["attention_dropout"] == 0.5
