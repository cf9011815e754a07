"""The one-tensor-at-a-time maps: exact inverses, both layer-spec spellings, and the export path the
megatron engine uses (all-gather TP shards -> merge_tp_shards -> mcore_to_hf_tensors) gives the HF tensors."""

from __future__ import annotations

import pytest
import torch
from ckpt_convert_testutil import ARCHS
from safetensors.torch import load_file

from ckpt_convert.mapping import (
    canonical_name,
    hf_to_mcore_tensors,
    mcore_names,
    mcore_to_hf_tensors,
    merge_tp_shards,
    split_tp_shard,
)
from ckpt_convert.mcore_model import load_hf_config, mcore_model_config


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_mcore_hf_is_identity(arch: str, tiny_ckpts: dict) -> None:
    hf_config = load_hf_config(tiny_ckpts[arch])
    cfg = mcore_model_config(hf_config, tp=2)
    hf = load_file(tiny_ckpts[arch] / "model.safetensors")
    mcore = hf_to_mcore_tensors(cfg, hf_config, hf)
    assert [n for n, _ in mcore] == mcore_names(cfg)
    back = dict(pair for name, full in mcore for pair in mcore_to_hf_tensors(cfg, hf_config, name, full))
    assert sorted(back) == sorted(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    for name, full in mcore:  # TP split/merge are inverses for every tensor
        shards = [split_tp_shard(cfg, name, full, r, 2) for r in range(2)]
        assert torch.equal(merge_tp_shards(cfg, name, shards), full)


def test_partial_groups_are_skipped_and_unknown_names_raise(tiny_ckpts: dict) -> None:
    hf_config = load_hf_config(tiny_ckpts["qwen2"])
    cfg = mcore_model_config(hf_config)
    hf = load_file(tiny_ckpts["qwen2"] / "model.safetensors")
    layer0 = {k: v for k, v in hf.items() if k.startswith("model.layers.0.") and "v_proj" not in k}
    got = dict(hf_to_mcore_tensors(cfg, hf_config, layer0))
    assert "decoder.layers.0.self_attention.linear_qkv.weight" not in got  # v_proj missing: not built yet
    assert "decoder.layers.0.mlp.linear_fc1.weight" in got
    with pytest.raises(ValueError, match="model.layers.0.mlp.gate_proj.bias"):
        hf_to_mcore_tensors(cfg, hf_config, {"model.layers.0.mlp.gate_proj.bias": torch.zeros(3)})


def test_local_and_te_names_are_the_same_tensor(tiny_ckpts: dict) -> None:
    dense = mcore_model_config(load_hf_config(tiny_ckpts["llama"]))
    moe = mcore_model_config(load_hf_config(tiny_ckpts["mixtral"]))
    assert canonical_name(dense, "module.module.decoder.layers.1.input_layernorm.weight") == \
        "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"
    assert canonical_name(dense, "decoder.layers.1.pre_mlp_layernorm.weight") == \
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight"
    assert canonical_name(moe, "decoder.layers.1.mlp.linear_fc1.layer_norm_weight") == \
        "decoder.layers.1.pre_mlp_layernorm.weight"
    with pytest.raises(ValueError, match="decoder.layers.7.mlp.router.weight.*not part of"):
        mcore_to_hf_tensors(moe, None, "decoder.layers.7.mlp.router.weight", torch.zeros(4, 128))


def _export_like_the_engine(rank: int, world_size: int, path, tp: int, ep: int) -> dict | None:
    """Load HF weights into a TP/EP-sharded GPTModel, then export: gather, merge, map to HF names."""
    import re

    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from ckpt_convert.mapping import hf_to_mcore_tensor
    from engine_megatron.model import build_gpt_model

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
    try:
        model_parallel_cuda_manual_seed(0)
        cfg = mcore_model_config(load_hf_config(path), tp=tp, ep=ep)
        model = build_gpt_model(cfg)
        hf = load_file(path / "model.safetensors")
        num_local = (cfg.transformer_config.num_moe_experts or ep) // ep
        offset = ps.get_expert_model_parallel_rank() * num_local

        def global_name(name: str) -> str:  # local expert index -> global (what the engine must do)
            return re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m.group(1)) + offset}.", name)

        tp_rank = ps.get_tensor_model_parallel_rank()
        with torch.no_grad():
            for name, param in model.named_parameters():
                full = hf_to_mcore_tensor(cfg, global_name(name), hf)
                param.copy_(split_tp_shard(cfg, name, full, tp_rank, tp))
        exported = {}
        for name, param in model.named_parameters():
            shards = [torch.empty_like(param) for _ in range(tp)]
            dist.all_gather(shards, param.detach(), group=ps.get_tensor_model_parallel_group())
            full = merge_tp_shards(cfg, name, shards)
            exported.update(mcore_to_hf_tensors(cfg, None, global_name(name), full))
        everything = [None] * world_size
        dist.all_gather_object(everything, exported)
        return {k: v for part in everything for k, v in part.items()} if rank == 0 else None
    finally:
        ps.destroy_model_parallel()


@pytest.mark.distributed
@pytest.mark.parametrize(("arch", "tp", "ep"), [("qwen3", 2, 1), ("qwen3_moe", 1, 2)])
def test_engine_export_path_gives_hf_tensors(arch: str, tp: int, ep: int, tiny_ckpts: dict) -> None:
    from rl_core.testing.distributed import run_distributed

    exported = run_distributed(_export_like_the_engine, world_size=2, args=(tiny_ckpts[arch], tp, ep))[0]
    hf = load_file(tiny_ckpts[arch] / "model.safetensors")
    assert sorted(exported) == sorted(hf)
    assert all(torch.equal(exported[k], hf[k]) for k in hf)
