"""HF out of a Megatron run: HF -> one train step -> save_hf equals the DTensor engine's save_hf after the
same step, and `ckpt-convert mcore2hf` of the engine checkpoint equals the engine's save_hf.

Both engines train one step on the same global batch with the same loss and AdamW settings (1 rank each,
fp32); their HF directories are read back from disk with safetensors, and the Megatron one is loaded with
transformers' AutoModelForCausalLM.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron_testutil import LOSS, global_batch, make_policy, weight_diffs

from ckpt_convert.cli import main as ckpt_convert_main
from rl_core.losses import ClippedPGLoss
from rl_core.testing.distributed import run_distributed

pytest.importorskip("engine_dtensor")


def _train_and_save(rank: int, world_size: int, engine_name: str, ckpt: str, out: str) -> None:
    from rl_core.registry import create_engine

    policy = make_policy(ckpt)
    if engine_name == "dtensor":
        policy.megatron_cfg, policy.dtensor_cfg = {"enabled": False}, {"enabled": True}
    engine = create_engine(policy)
    batch = global_batch(0)
    engine.train_batch(batch, ClippedPGLoss(LOSS))
    engine.save_hf(f"{out}/hf")
    if engine_name == "megatron":
        engine.save_checkpoint(f"{out}/engine_ckpt")


def _read_hf(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.distributed
def test_megatron_save_hf_equals_dtensor_and_mcore2hf(tiny_ckpt, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    ckpt = tiny_ckpt("qwen2")
    for engine_name in ("megatron", "dtensor"):
        run_distributed(_train_and_save, world_size=1, args=(engine_name, ckpt, str(tmp_path / engine_name)))
    megatron, dtensor = _read_hf(tmp_path / "megatron/hf"), _read_hf(tmp_path / "dtensor/hf")
    initial = _read_hf(Path(ckpt))
    rel, absolute = weight_diffs(megatron, dtensor)
    moved, _ = weight_diffs(megatron, initial)
    assert moved > 1e-4 and rel <= 1e-5, (moved, rel, absolute)  # trained, and the same step as DTensor
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "megatron/hf", dtype=torch.float32)
    # the same names both ways (untied embeddings; rotary inv_freq is a non-persistent buffer): a config.json
    # that disagrees with the weights would leave HF parameters randomly initialised, or weights unread
    state = loaded.state_dict()
    assert state.keys() == megatron.keys(), sorted(state.keys() ^ megatron.keys())
    assert all(torch.equal(p, megatron[n]) for n, p in state.items())
    assert (tmp_path / "megatron/hf/tokenizer.json").exists()

    converted = tmp_path / "converted"
    assert ckpt_convert_main(["mcore2hf", "--mcore", str(tmp_path / "megatron/engine_ckpt"),
                              "--out", str(converted)]) == 0
    from_ckpt = _read_hf(converted)
    assert from_ckpt.keys() == megatron.keys()
    assert all(torch.equal(from_ckpt[n], megatron[n]) for n in megatron)  # bit-exact
