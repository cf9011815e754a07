"""Meta-device initialisation with weights streamed from safetensors into the shards gives exactly the model
that `from_pretrained` loads: every parameter and buffer bitwise, on 1 rank, FSDP over 2 ranks and TP=2;
with a multi-file checkpoint, tied embeddings, llama3 rope scaling (a non-default inv_freq) and MoE experts
(stored per expert, fused in memory)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from engine_dtensor.engine import DTensorEngine
from engine_dtensor.loading import build_meta_model, materialize
from engine_dtensor.parallelize import hf_name
from engine_dtensor.testing import make_policy
from rl_core.testing.distributed import run_distributed
from rl_core.testing.tiny_models import save_tiny_checkpoint

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def _engine_state(rank: int, world: int, path: str, tp: int) -> dict | None:
    """Full parameters and buffers of the engine's model, by HF name (rank 0)."""
    engine = DTensorEngine(make_policy(path, dtensor_cfg={"tensor_parallel_size": tp}))
    out = {}
    for name, tensor in [*engine.model.named_parameters(), *engine.model.named_buffers()]:
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        out[hf_name(name)] = full.detach().clone()
    return out if rank == 0 else None


def _plain_state(path: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return {n: t.detach() for n, t in [*model.named_parameters(), *model.named_buffers()]}


def _assert_bitwise(state: dict, ref: dict) -> None:
    assert state.keys() == ref.keys()
    for name in ref:
        assert torch.equal(state[name], ref[name]), f"{name} differs from from_pretrained"


@pytest.fixture(scope="module")
def sharded_ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Multi-file checkpoints (several safetensors shards + index), built once."""
    root = tmp_path_factory.mktemp("meta-init")
    return {
        "qwen3": str(save_tiny_checkpoint(root / "qwen3", "qwen3", seed=5, max_shard_size="200KB")),
        # transformers fuses the experts in memory: per-expert tensors, spread over files, make one parameter
        "qwen3_moe": str(save_tiny_checkpoint(root / "qwen3_moe", "qwen3_moe", seed=7, max_shard_size="200KB")),
        "llama_tied": str(save_tiny_checkpoint(root / "llama_tied", "llama", seed=6, max_shard_size="200KB",
                                               tie_word_embeddings=True, rope_scaling=LLAMA3_ROPE)),
    }


@pytest.mark.distributed
@pytest.mark.parametrize(("arch", "world", "tp"), [("qwen3", 1, 1), ("llama_tied", 2, 1), ("qwen3", 2, 1),
                                                    ("qwen3", 2, 2), ("qwen3_moe", 2, 1)])
def test_meta_init_equals_from_pretrained(sharded_ckpts: dict, arch: str, world: int, tp: int) -> None:
    path = sharded_ckpts[arch]
    assert len(list(Path(path).glob("*.safetensors"))) > 1  # really streamed file by file
    state = run_distributed(_engine_state, world, args=(path, tp))[0]
    _assert_bitwise(state, _plain_state(path))


def test_tied_embedding_stays_tied_after_materialize(sharded_ckpts: dict) -> None:
    import torch.distributed as dist

    path = sharded_ckpts["llama_tied"]
    model = build_meta_model(path, "sdpa")
    assert not dist.is_initialized()  # no process group needed for a plain (unsharded) model
    materialize(model, path, torch.device("cpu"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    _assert_bitwise({n: t for n, t in [*model.named_parameters(), *model.named_buffers()]}, _plain_state(path))


def _exported(rank: int, world: int, path: str) -> dict | None:
    engine = DTensorEngine(make_policy(path))
    out = {}
    for name, tensor in engine.export_hf_weights():
        assert name not in out, f"{name} exported twice"
        out[name] = tensor.clone()
    return out if rank == 0 else None


@pytest.mark.distributed
def test_tied_embedding_is_exported_once(sharded_ckpts: dict) -> None:
    """Export (refit's source) yields what the HF checkpoint holds: the tied embedding once, not as lm_head too."""
    from safetensors.torch import load_file

    path = sharded_ckpts["llama_tied"]
    stored = {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()}
    exported = run_distributed(_exported, 2, args=(path,))[0]
    assert "lm_head.weight" not in stored and exported.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.equal(exported[name], tensor), name


def test_checkpoint_without_a_tensor_names_it(tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    path = save_tiny_checkpoint(tmp_path / "ckpt", "qwen2", seed=1)
    weights = load_file(path / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"no tensor for \['model.norm.weight'\]"):
        materialize(build_meta_model(str(path), "sdpa"), str(path), torch.device("cpu"))


def test_buffer_owning_embedding_keeps_its_loaded_weights(tmp_path) -> None:
    """Gemma2's embedding owns the non-persistent `embed_scale` buffer: recomputing that buffer must not
    re-draw the embedding's loaded weights."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    config = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    model = build_meta_model(str(tmp_path), "eager")
    materialize(model, str(tmp_path), torch.device("cpu"))
    _assert_bitwise({n: t for n, t in [*model.named_parameters(), *model.named_buffers()]},
                    _plain_state(str(tmp_path)))


def test_check_model_refuses_a_model_without_decoder_layers_from_its_config(tmp_path):
    """GPT-2 keeps its blocks in `transformer.h`: the engine cannot wrap them, and says so from config.json (the
    trainer's preflight) instead of after the workers loaded it."""
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has no `model.layers` ModuleList.*Llama, Qwen2"):
        DTensorEngine.check_model(make_policy(str(tmp_path)))
    DTensorEngine.check_model(make_policy(str(save_tiny_checkpoint(tmp_path / "qwen2", "qwen2"))))


@pytest.mark.parametrize(("arch", "message"), [
    ("qwen3_moe", r"tensor_parallel_size=2 is not supported for model_type 'qwen3_moe'"),
    ("llama", r"num_key_value_heads=\d+ is not divisible by policy\.dtensor_cfg\.tensor_parallel_size=4"),
])
def test_check_model_refuses_a_tensor_parallel_size_the_model_has_no_plan_for(tmp_path, arch, message):
    """Found by the policy actors after Ray and the model load before; from config.json now (the preflight)."""
    from rl_core.testing.tiny_models import tiny_config

    tiny_config(arch).save_pretrained(tmp_path)
    tp = 2 if arch == "qwen3_moe" else 4
    with pytest.raises(ValueError, match=message):
        DTensorEngine.check_model(make_policy(str(tmp_path), dtensor_cfg={"tensor_parallel_size": tp}))
