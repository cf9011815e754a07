"""A megatron GPTModel built by build_gpt_model, with weights mapped from HF, gives the HF logits."""

from __future__ import annotations

import pytest
import torch
from ckpt_convert_testutil import ARCHS, TOKENS, hf_logits
from safetensors.torch import load_file

from ckpt_convert.mcore_model import SUPPORTED_ARCHITECTURES, load_hf_config, mcore_model_config


def _load_hf_weights(path) -> dict:
    out: dict = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _megatron_logits(rank: int, world_size: int, path, tp: int, sequence_parallel: bool = False) -> torch.Tensor | None:
    """Build the GPTModel at TP=tp, copy HF weights in through the mapping, return full-vocab logits."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import (
        gather_from_tensor_model_parallel_region,
        model_parallel_cuda_manual_seed,
    )

    from ckpt_convert.mapping import canonical_name, hf_to_mcore_tensor, split_tp_shard
    from engine_megatron.model import build_gpt_model

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        model_parallel_cuda_manual_seed(0)
        cfg = mcore_model_config(load_hf_config(path), tp=tp, sequence_parallel=sequence_parallel)
        model = build_gpt_model(cfg)
        if not sequence_parallel:
            model.eval()  # megatron refuses MoE + TP without SP in training mode
        hf = _load_hf_weights(path)
        state = {}
        for name, param in model.state_dict().items():
            if not torch.is_tensor(param) or name.endswith("_extra_state"):
                continue
            full = hf_to_mcore_tensor(cfg, canonical_name(cfg, name), hf)
            state[name] = split_tp_shard(cfg, name, full, ps.get_tensor_model_parallel_rank(), tp)
        missing = model.load_state_dict(state, strict=False).missing_keys
        assert [k for k in missing if not k.endswith("_extra_state")] == []
        positions = torch.arange(TOKENS.shape[1]).expand_as(TOKENS)
        with torch.no_grad():
            logits = model(TOKENS, positions, None)  # (B, S, V_padded / tp)
            logits = gather_from_tensor_model_parallel_region(logits)
        return logits[..., : cfg.hf_vocab_size] if rank == 0 else None
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("arch", ARCHS)
def test_gpt_model_matches_hf_logits_tp1(arch: str, tiny_ckpts: dict, ref_logits: dict) -> None:
    from rl_core.testing.distributed import run_distributed

    ref = ref_logits[arch]
    got = run_distributed(_megatron_logits, world_size=1, args=(tiny_ckpts[arch], 1))[0]
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_gpt_model_matches_hf_logits_tp2(arch: str, tiny_ckpts: dict, ref_logits: dict) -> None:
    from rl_core.testing.distributed import run_distributed

    ref = ref_logits[arch]
    got = run_distributed(_megatron_logits, world_size=2, args=(tiny_ckpts[arch], 2))[0]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)


@pytest.mark.distributed
def test_sequence_parallel_moe_training_mode_matches_hf(tiny_ckpts: dict, ref_logits: dict) -> None:
    """TP=2 + sequence parallel (the MoE training setup; uses the CPU norm patch) still gives the HF logits."""
    from rl_core.testing.distributed import run_distributed

    got = run_distributed(_megatron_logits, world_size=2, args=(tiny_ckpts["qwen3_moe"], 2, True))[0]
    torch.testing.assert_close(got, ref_logits["qwen3_moe"], rtol=0, atol=1e-5)


def test_unknown_architecture_lists_supported(tmp_path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}')
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM") as err:
        load_hf_config(tmp_path)
    assert all(a in str(err.value) for a in SUPPORTED_ARCHITECTURES)


def test_tp_not_dividing_heads_names_fix(tiny_ckpts: dict) -> None:
    hf = load_hf_config(tiny_ckpts["llama"])  # 4 heads, 2 kv heads
    with pytest.raises(ValueError, match=r"tp=3 does not divide num_attention_heads=4; choose --tp from \[1, 2\]"):
        mcore_model_config(hf, tp=3)


def test_unknown_override_suggests_field(tiny_ckpts: dict) -> None:
    hf = load_hf_config(tiny_ckpts["llama"])
    with pytest.raises(ValueError, match="'recompute_granulariti'.*'recompute_granularity'"):
        mcore_model_config(hf, overrides={"recompute_granulariti": "full"})
    cfg = mcore_model_config(hf, overrides={"recompute_granularity": "full", "recompute_method": "uniform",
                                            "recompute_num_layers": 1})
    assert cfg.transformer_config.recompute_granularity == "full"


def test_config_fields(tiny_ckpts: dict) -> None:
    hf = load_hf_config(tiny_ckpts["qwen3_moe"])
    cfg = mcore_model_config(hf, tp=2)
    tc = cfg.transformer_config
    assert (cfg.vocab_size, cfg.hf_vocab_size) == (256, 100)
    assert (tc.num_query_groups, tc.kv_channels, tc.qk_layernorm, tc.num_moe_experts) == (2, 32, True, 4)
    assert (tc.moe_router_topk, tc.moe_ffn_hidden_size, tc.layernorm_epsilon) == (2, 128, 1e-6)


@pytest.mark.parametrize(("arch", "overrides"), [
    ("llama", {"tie_word_embeddings": True}),
    ("mistral", {"sliding_window": 5}),  # shorter than TOKENS: the window really masks
    ("mixtral", {"sliding_window": 5}),  # every layer, as Mistral
    ("qwen3_moe", {"num_experts_per_tok": 1, "norm_topk_prob": False}),  # top-1 weighted by its probability
    ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 0}),  # layer_types: all sliding
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 4.0,
                                   "low_freq_factor": 2.0, "high_freq_factor": 3.0,
                                   "original_max_position_embeddings": 8}}),
])
def test_config_variants_match_hf(arch: str, overrides: dict, tmp_path) -> None:
    """Tied embeddings, sliding windows (Mistral's, Mixtral's, Qwen2's when every layer slides), llama3 rope
    scaling and top-1 routing without renormalisation (megatron's pre-softmax router) give the HF logits too, and the checkpoint converts HF -> mcore -> HF bit-exactly."""
    from ckpt_convert.convert import convert_hf_to_mcore, convert_mcore_to_hf
    from rl_core.testing.distributed import run_distributed
    from rl_core.testing.tiny_models import save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path / arch, arch, seed=4, vocab_size=100, **overrides)
    ref = hf_logits(path)
    got = run_distributed(_megatron_logits, world_size=1, args=(path, 1))[0]
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-5)
    back = convert_mcore_to_hf(convert_hf_to_mcore(path, tmp_path / "mcore"), tmp_path / "back")
    original, restored = _load_hf_weights(path), _load_hf_weights(back)
    assert sorted(original) == sorted(restored)
    assert all(torch.equal(original[k], restored[k]) for k in original)


@pytest.mark.parametrize(("arch", "overrides"), [("mixtral", {"num_experts_per_tok": 1}),
                                               ("qwen3_moe", {"num_experts_per_tok": 1, "norm_topk_prob": True})])
def test_top1_routing_with_renormalised_weights_is_refused(arch: str, overrides: dict) -> None:
    """The chosen expert weighted 1.0 has no megatron router: a clear error, not megatron's CLI hint
    'Please use --moe-router-pre-softmax when topk is 1.' (whose model would weigh it by its probability)."""
    from rl_core.testing.tiny_models import tiny_config

    with pytest.raises(ValueError, match=r"num_experts_per_tok=1 and renormalised routing weights .* no megatron"):
        mcore_model_config(tiny_config(arch, **overrides))


def test_sliding_window_on_some_layers_only_is_refused() -> None:
    """Qwen2 slides from layer max_window_layers on; megatron has one window for all layers: an error, not
    full attention everywhere (the window used to be dropped without a word)."""
    from rl_core.testing.tiny_models import tiny_config

    mixed = tiny_config("qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1)
    with pytest.raises(ValueError, match=r"layer_types mixing full and sliding-window attention.*max_window_layers=1"):
        mcore_model_config(mixed)
    assert mcore_model_config(tiny_config("qwen2")).transformer_config.window_size is None
