"""`DTensorEngine.checkpoint_to_hf`: a checkpoint becomes, offline, the HF directory the live engine's save_hf
writes (every tensor equal, the same logits; with LoRA the same PEFT adapter too), for FSDP and TP layouts, tied,
untied and MoE models; refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine_dtensor.checkpoint import ADAPTER_DIR
from engine_dtensor.engine import DTensorEngine
from engine_dtensor.testing import grpo_batch, make_policy, max_abs_diff
from rl_core.checkpoint_io import MANIFEST_FILE, CheckpointError, verify_manifest
from rl_core.losses import ClippedPGLoss
from rl_core.testing.distributed import run_distributed
from rl_core.testing.tiny_models import cached_tiny_checkpoint


def _train_and_save(rank: int, world: int, path: str, batch, dtensor_cfg: dict, ckpt_dir: str, hf_dir: str) -> list:
    """Two training steps, then the engine checkpoint and the live save_hf of the same weights."""
    engine = DTensorEngine(make_policy(path, dtensor_cfg=dtensor_cfg, logprob_batch_size=1))
    tp = dtensor_cfg.get("tensor_parallel_size", 1)
    shard = batch if tp == world else batch.select(list(range(rank, len(batch), world)))
    for _ in range(2):
        engine.train_batch(shard, ClippedPGLoss())
    engine.save_checkpoint(ckpt_dir)
    engine.save_hf(hf_dir)
    return engine.compute_logprobs(batch)


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(file)))
    return out


def _logprobs(model_dir: Path | str, seqs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Plain HF forward of each sequence, fp32: (L_i - 1,) target-token logprobs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(input_ids=ids[None]).logits[0, :-1], -1).gather(-1, ids[1:, None])[:, 0]
                for ids in seqs]


# LoRA: the adapters (on the attention projections only, alpha/dim = 4) are merged from the checkpoint's lora.json
LORA = {"lora_cfg": {"enabled": True, "dim": 4, "alpha": 16.0, "target_modules": ["q_proj", "k_proj", "v_proj",
                                                                                  "o_proj"]}}


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("arch", "overrides", "dtensor_cfg"),
    [("llama", {}, {"tensor_parallel_size": 2}), ("qwen2", {"tie_word_embeddings": True}, {}), ("qwen3_moe", {}, {}),
     ("qwen2", {}, LORA)],
    ids=["llama-tp2", "qwen2-tied-fsdp2", "qwen3_moe-fsdp2", "qwen2-lora-fsdp2"],
)
def test_offline_export_equals_live_save_hf(tmp_path, arch: str, overrides: dict, dtensor_cfg: dict) -> None:
    path = str(cached_tiny_checkpoint(arch, **overrides))
    batch = grpo_batch(path, lengths=[6, 11, 4, 9])
    ckpt_dir, live, offline = tmp_path / "ckpt", tmp_path / "live", tmp_path / "offline"
    engine_logprobs = run_distributed(_train_and_save, 2, args=(path, batch, dtensor_cfg, str(ckpt_dir), str(live)))[0]

    DTensorEngine.checkpoint_to_hf(str(ckpt_dir), str(offline), model_dir=path)  # this process: no dist

    exported, reference = _safetensors(offline), _safetensors(live)
    assert exported.keys() == reference.keys()
    assert all(torch.equal(exported[k], reference[k]) for k in reference)
    if overrides.get("tie_word_embeddings"):
        assert "lm_head.weight" not in exported  # written once, as save_hf does; from_pretrained re-ties
    assert sorted(exported) == sorted(_safetensors(Path(path)))  # on-disk HF names (MoE: per expert again)
    assert json.loads((offline / "config.json").read_text()) == json.loads((live / "config.json").read_text())
    assert (offline / "tokenizer.json").exists()
    _assert_same_adapter(live, offline, lora="lora_cfg" in dtensor_cfg)

    loaded = _logprobs(offline, batch.input_ids)
    # the engine's trained model; layout rounding only (LoRA: and W x + s B A x computed as (W + s B A) x)
    tolerance = 1e-5 if "lora_cfg" in dtensor_cfg else 2e-6
    for lp, engine_lp in zip(loaded, engine_logprobs):
        assert (lp - engine_lp[1:]).abs().max() <= tolerance
    assert max_abs_diff(loaded, _logprobs(path, batch.input_ids)) > 1e-4  # training changed the weights


def _assert_same_adapter(live: Path, offline: Path, *, lora: bool) -> None:
    """A LoRA run's PEFT adapter (the FSDP shards gathered live, the checkpoint's offline): the same file contents,
    every tensor equal, inside the HF directory's manifest; none without LoRA."""
    if not lora:
        assert not (live / ADAPTER_DIR).exists() and not (offline / ADAPTER_DIR).exists()
        return
    live_adapter, offline_adapter = _safetensors(live / ADAPTER_DIR), _safetensors(offline / ADAPTER_DIR)
    assert offline_adapter.keys() == live_adapter.keys()
    assert len(live_adapter) == 2 * 2 * 4  # A and B of q, k, v, o in 2 layers
    assert all(torch.equal(offline_adapter[k], live_adapter[k]) for k in live_adapter)
    assert any(k.endswith(".lora_B.weight") and torch.count_nonzero(t) for k, t in live_adapter.items())  # trained
    config = (live / ADAPTER_DIR / "adapter_config.json").read_text()
    assert (offline / ADAPTER_DIR / "adapter_config.json").read_text() == config
    for directory in (live, offline):  # the adapter is part of the atomic, manifested HF directory
        verify_manifest(directory)
        listed = json.loads((directory / MANIFEST_FILE).read_text())["files"]
        assert {f"{ADAPTER_DIR}/adapter_model.safetensors", f"{ADAPTER_DIR}/adapter_config.json"} <= listed.keys()


def _save_checkpoint(rank: int, world: int, path: str, ckpt_dir: str) -> None:
    DTensorEngine(make_policy(path)).save_checkpoint(ckpt_dir)


@pytest.fixture(scope="module")
def untrained_checkpoint(tmp_path_factory) -> tuple[str, Path]:
    path = str(cached_tiny_checkpoint("llama"))
    ckpt_dir = tmp_path_factory.mktemp("untrained") / "ckpt"
    run_distributed(_save_checkpoint, 1, args=(path, str(ckpt_dir)))
    return path, ckpt_dir


def test_existing_output_directory_is_refused(untrained_checkpoint, tmp_path) -> None:
    path, ckpt_dir = untrained_checkpoint
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="already exists; remove it or choose another"):
        DTensorEngine.checkpoint_to_hf(str(ckpt_dir), str(tmp_path / "out"), model_dir=path)
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_damaged_checkpoint_is_refused_naming_the_file(untrained_checkpoint, tmp_path) -> None:
    path, ckpt_dir = untrained_checkpoint
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for file in ckpt_dir.iterdir():
        (damaged / file.name).write_bytes(file.read_bytes())
    victim = sorted(damaged.glob("*.distcp"))[0]
    victim.write_bytes(victim.read_bytes()[:100])  # truncated
    with pytest.raises(CheckpointError, match=victim.name):
        DTensorEngine.checkpoint_to_hf(str(damaged), str(tmp_path / "out"), model_dir=path)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.parametrize(("saved", "given"), [("llama", "qwen2"), ("qwen2", "llama")],
                         ids=["missing-weights", "extra-weights"])
def test_checkpoint_of_another_model_is_refused(tmp_path, saved: str, given: str) -> None:
    """qwen2 has q/k/v biases that llama has not: a weight the model lacks (as a LoRA adapter would be) is refused,
    not dropped."""
    ckpt_dir = tmp_path / "ckpt"
    run_distributed(_save_checkpoint, 1, args=(str(cached_tiny_checkpoint(saved)), str(ckpt_dir)))
    with pytest.raises(ValueError, match="does not hold the weights of the model .*q_proj.bias.*pass the run's "
                                         "policy.model_name"):
        DTensorEngine.checkpoint_to_hf(str(ckpt_dir), str(tmp_path / "out"),
                                       model_dir=str(cached_tiny_checkpoint(given)))
    assert not (tmp_path / "out").exists()


def _save_lora_checkpoint(rank: int, world: int, path: str, ckpt_dir: str) -> None:
    DTensorEngine(make_policy(path, dtensor_cfg=LORA)).save_checkpoint(ckpt_dir)


@pytest.mark.distributed
def test_lora_checkpoint_needs_its_own_base_model(tmp_path) -> None:
    """A LoRA checkpoint holds the adapters alone: its base comes from model_dir, which must exist and hold the
    base it was trained on (the same shapes with other weights are refused too), each error naming the fix."""
    import shutil

    path = str(cached_tiny_checkpoint("qwen2"))
    ckpt_dir = tmp_path / "ckpt"
    run_distributed(_save_lora_checkpoint, 1, args=(path, str(ckpt_dir)))
    gone = tmp_path / "moved"
    with pytest.raises(ValueError, match=rf"the base model directory {gone} of LoRA checkpoint {ckpt_dir} does not "
                                         r"exist \(the checkpoint holds the adapters only\): pass the directory of "
                                         r"that base with model_dir \(uv run apps/grpo export --base-model DIR\)"):
        DTensorEngine.checkpoint_to_hf(str(ckpt_dir), str(tmp_path / "out"), model_dir=str(gone))
    other = str(cached_tiny_checkpoint("qwen2", seed=1))
    with pytest.raises(ValueError, match=rf"LoRA checkpoint {ckpt_dir} was trained on the base model at {path} .*"
                                         rf"the base directory this run uses, {other}, holds another model .*: point "
                                         r"model_dir \(uv run apps/grpo export --base-model DIR\) at the base"):
        DTensorEngine.checkpoint_to_hf(str(ckpt_dir), str(tmp_path / "out"), model_dir=other)
    assert not (tmp_path / "out").exists()
    moved = shutil.copytree(path, gone)  # the base in another directory: found there, the same weights
    DTensorEngine.checkpoint_to_hf(str(ckpt_dir), str(tmp_path / "out"), model_dir=str(moved))
    assert (tmp_path / "out" / ADAPTER_DIR / "adapter_model.safetensors").is_file()
