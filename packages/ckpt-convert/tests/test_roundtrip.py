"""HF -> mcore -> HF is bit-exact, and megatron loads the converted checkpoint at TP/PP/EP and gives the HF
logits; a checkpoint megatron itself saved sharded (TP=2, PP=2, EP=2) converts back to the original HF."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from ckpt_convert_testutil import ARCHS, MOE_ARCHS, TOKENS, hf_logits
from safetensors.torch import load_file

from ckpt_convert.convert import CONFIG_NAME, convert_hf_to_mcore, convert_mcore_to_hf


def _hf_tensors(path: Path) -> dict:
    out: dict = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_bit_exact(original: Path, converted: Path) -> None:
    a, b = _hf_tensors(original), _hf_tensors(converted)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("arch", ARCHS)
def test_roundtrip_bit_exact(arch: str, tiny_ckpts: dict, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mcore = convert_hf_to_mcore(tiny_ckpts[arch], tmp_path / "mcore", tp=2)
    with caplog.at_level(logging.INFO, logger="ckpt_convert.convert"):
        back = convert_mcore_to_hf(mcore, tmp_path / "hf")
    _assert_bit_exact(tiny_ckpts[arch], back)
    written = len(load_file(back / "model.safetensors"))  # the log counts HF tensors, not megatron's fused ones
    assert f"mcore2hf wrote {tmp_path / 'hf'}: {written} tensors" in caplog.text
    original = json.loads((tiny_ckpts[arch] / "config.json").read_text())
    restored = json.loads((back / "config.json").read_text())
    assert {k: v for k, v in restored.items() if k != "transformers_version"} == \
        {k: v for k, v in original.items() if k != "transformers_version"}
    assert (back / "tokenizer.json").read_bytes() == (tiny_ckpts[arch] / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "mcore"]  # no temp dirs left


def _megatron_load_and_save(rank: int, world_size: int, jobs: list, tp: int, pp: int, ep: int) -> list:
    """For each (converted dir, save dir, HF logits): load into a GPTModel at tp/pp/ep with megatron's
    dist_checkpointing, return max |logits - HF| (pp=1 only), then save it again with megatron."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import (
        gather_from_tensor_model_parallel_region,
        model_parallel_cuda_manual_seed,
    )

    from ckpt_convert.convert import load_model_config
    from ckpt_convert.dist_format import load_into_model
    from engine_megatron.model import build_gpt_model

    diffs = []
    for converted, save_dir, ref_logits in jobs:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     expert_model_parallel_size=ep)
        try:
            model_parallel_cuda_manual_seed(0)
            _, cfg = load_model_config(converted, tp=tp, pp=pp, ep=ep)
            model = build_gpt_model(cfg).eval()
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(7.0)  # every value must come from the checkpoint
            if world_size == 1:  # the plain megatron API (our files carry the local spec's extra states)
                model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), str(converted)))
            else:
                load_into_model(model, converted)
            if pp == 1:
                with torch.no_grad():
                    logits = model(TOKENS, torch.arange(TOKENS.shape[1]).expand_as(TOKENS), None)
                    logits = gather_from_tensor_model_parallel_region(logits)[..., : cfg.hf_vocab_size]
                diffs.append((logits - ref_logits).abs().max().item())
            if rank == 0:
                Path(save_dir).mkdir()
            dist.barrier()
            dist_checkpointing.save(model.sharded_state_dict(), str(save_dir))
        finally:
            ps.destroy_model_parallel()
    return diffs


def _run_layout(tiny_ckpts: dict, ref_logits: dict, tmp_path: Path, archs: tuple, tp: int, pp: int, ep: int,
                world_size: int) -> None:
    from rl_core.testing.distributed import run_distributed

    jobs = []
    for arch in archs:
        converted = convert_hf_to_mcore(tiny_ckpts[arch], tmp_path / f"{arch}-mcore", tp=tp, pp=pp, ep=ep)
        jobs.append((converted, tmp_path / f"{arch}-megatron-saved", ref_logits[arch]))
    diffs = run_distributed(_megatron_load_and_save, world_size=world_size, args=(jobs, tp, pp, ep))
    for rank_diffs in diffs:
        assert all(d <= 1e-5 for d in rank_diffs), dict(zip(archs, rank_diffs))
    for arch, (converted, saved, _) in zip(archs, jobs):
        (saved / CONFIG_NAME).write_bytes((converted / CONFIG_NAME).read_bytes())
        _assert_bit_exact(tiny_ckpts[arch], convert_mcore_to_hf(saved, tmp_path / f"{arch}-hf"))


def test_megatron_tp1_logits_and_roundtrip(tiny_ckpts: dict, ref_logits: dict, tmp_path: Path) -> None:
    _run_layout(tiny_ckpts, ref_logits, tmp_path, ARCHS, tp=1, pp=1, ep=1, world_size=1)


@pytest.mark.distributed
def test_megatron_tp2_logits_and_roundtrip(tiny_ckpts: dict, ref_logits: dict, tmp_path: Path) -> None:
    _run_layout(tiny_ckpts, ref_logits, tmp_path, ARCHS, tp=2, pp=1, ep=1, world_size=2)


@pytest.mark.distributed
def test_megatron_pp2_roundtrip(tiny_ckpts: dict, ref_logits: dict, tmp_path: Path) -> None:
    _run_layout(tiny_ckpts, ref_logits, tmp_path, ARCHS, tp=1, pp=2, ep=1, world_size=2)


@pytest.mark.distributed
def test_megatron_ep2_logits_and_roundtrip(tiny_ckpts: dict, ref_logits: dict, tmp_path: Path) -> None:
    _run_layout(tiny_ckpts, ref_logits, tmp_path, MOE_ARCHS, tp=1, pp=1, ep=2, world_size=2)


def test_multi_shard_in_and_out(tmp_path: Path) -> None:
    """Sharded input (index.json) and sharded output: still bit-exact, and transformers loads the output."""
    from rl_core.testing.tiny_models import save_tiny_checkpoint

    hf = save_tiny_checkpoint(tmp_path / "hf", "mixtral", seed=5, vocab_size=100, max_shard_size="300KB")
    assert len(list(hf.glob("*.safetensors"))) > 2
    mcore = convert_hf_to_mcore(hf, tmp_path / "mcore")
    back = convert_mcore_to_hf(mcore, tmp_path / "back", max_shard_bytes=300_000)
    shards = sorted(p.name for p in back.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    _assert_bit_exact(hf, back)
    torch.testing.assert_close(hf_logits(back), hf_logits(hf), rtol=0, atol=0)


def _fake_extra_state_is_dropped(rank: int, world_size: int, converted: Path) -> list:
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    from ckpt_convert.convert import load_model_config
    from ckpt_convert.dist_format import drop_absent_objects
    from engine_megatron.model import build_gpt_model

    ps.initialize_model_parallel()
    try:
        model = build_gpt_model(load_model_config(converted)[1])
        sharded = model.sharded_state_dict()
        sharded["te_only._extra_state"] = ShardedObject("decoder.layers.core_attention._extra_state", None, (2,), (0,))
        before = set(sharded)
        dropped = drop_absent_objects(sharded, converted)
        assert set(sharded) == before - {"te_only._extra_state"}
        return dropped
    finally:
        ps.destroy_model_parallel()


def test_absent_extra_state_objects_are_dropped(tiny_ckpts: dict, tmp_path: Path) -> None:
    """A TE-spec model asks for _extra_state objects our checkpoint does not hold: only those are dropped."""
    from rl_core.testing.distributed import run_distributed

    converted = convert_hf_to_mcore(tiny_ckpts["llama"], tmp_path / "mcore")
    assert run_distributed(_fake_extra_state_is_dropped, world_size=1, args=(converted,)) == [
        ["te_only._extra_state"]]
