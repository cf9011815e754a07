"""policy.megatron_cfg validation: unknown keys, TransformerConfig pass-through, cross-field errors, early."""

from __future__ import annotations

import pytest
from megatron_testutil import make_policy

from engine_megatron.config import CUDA_FUSIONS, parse_megatron_config, resolve_settings
from rl_core.config import ConfigError
from rl_core.testing.distributed import run_distributed
from rl_core.testing.tiny_models import tiny_config


def test_unknown_key_names_the_closest_field() -> None:
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.tensor_model_paralel_size.*did you mean "
                                          r"'policy\.megatron_cfg\.tensor_model_parallel_size'"):
        parse_megatron_config({"tensor_model_paralel_size": 2})


def test_every_unknown_key_of_the_section_is_named_in_one_error() -> None:
    """A config brought from NeMo-RL has several keys this engine lacks: one error names them all (it was one a run),
    each with its closest field; the keys of megatron's optimizer section likewise."""
    with pytest.raises(ConfigError, match=r"^unknown config keys 'policy\.megatron_cfg\.converter_type'( \(did you mean [^)]*\))?, "
                                          r"'policy\.megatron_cfg\.tensor_model_paralel_size' \(did you mean "
                                          r"'policy\.megatron_cfg\.tensor_model_parallel_size'\?\)\. Keys other"):
        parse_megatron_config({"converter_type": "Qwen2ForCausalLM", "tensor_model_paralel_size": 2, "bf16": True})
    with pytest.raises(ConfigError, match=r"^unknown config keys 'policy\.megatron_cfg\.optimizer\.lrr' \(did you mean "
                                          r"'policy\.megatron_cfg\.optimizer\.lr'\?\), 'policy\.megatron_cfg\.optimizer\."
                                          r"clip_gradd' \(did you mean 'policy\.megatron_cfg\.optimizer\.clip_grad'\?\)"):
        parse_megatron_config({"optimizer": {"lrr": 1e-5, "clip_gradd": 1.0, "adam_beta1": 0.9}})


def test_unknown_transformer_key_names_the_closest_field() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'policy\.megatron_cfg\.apply_rope_fusion'"):
        parse_megatron_config({"apply_rope_fusio": True})


@pytest.mark.parametrize(("raw", "message"), [
    ({"lora_cfg": {"enabled": True, "dim": 0}}, r"policy\.megatron_cfg\.lora_cfg\.dim must be >= 1"),
    ({"lora_cfg": {"droput": 0.1}}, r"did you mean 'policy\.megatron_cfg\.lora_cfg\.dropout'"),
    ({"lora_cfg": {"enabled": True, "dropout": 0.1}, "tensor_model_parallel_size": 2},
     r"lora_cfg\.dropout=0 or tensor_model_parallel_size=1"),  # one dropout mask per TP group: refused
    ({"lora": {"enabled": True}}, r"did you mean 'policy\.megatron_cfg\.lora_cfg'"),
])
def test_lora_errors_name_the_megatron_key(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_megatron_config(raw)
    assert parse_megatron_config({"lora_cfg": {"enabled": True, "dim": 4}}).lora_cfg.scaling == 8.0


def test_lora_asked_of_the_dtensor_section_on_the_megatron_engine_is_an_error() -> None:
    """Not the generic 'unused section' warning: the run would silently train every weight instead of adapters."""
    from engine_megatron.engine import MegatronEngine

    with pytest.raises(ConfigError, match=r"policy\.dtensor_cfg\.lora_cfg\.enabled=true, but the 'megatron' engine "
                                          r"runs \(policy\.megatron_cfg\.enabled\).*LoRA goes under "
                                          r"policy\.megatron_cfg\.lora_cfg"):
        make_policy("unused", dtensor_cfg={"lora_cfg": {"enabled": True, "dim": 16}})
    MegatronEngine.validate_config(make_policy("unused", dtensor_cfg={"lora_cfg": {"enabled": False}}))


def test_nested_sections_are_checked_against_megatron() -> None:
    with pytest.raises(ConfigError, match=r"megatron_cfg\.optimizer\.adam_beta3.*adam_beta"):
        parse_megatron_config({"optimizer": {"adam_beta3": 0.9}})
    with pytest.raises(ConfigError, match=r"distributed_data_parallel_config\.bucket_sise.*bucket_size"):
        parse_megatron_config({"distributed_data_parallel_config": {"bucket_sise": 10}})
    with pytest.raises(ConfigError, match=r"distributed_data_parallel_config\.overlap_param_gather=true is not "):
        parse_megatron_config({"distributed_data_parallel_config": {"overlap_param_gather": True}})
    with pytest.raises(ConfigError, match=r"optimizer\.use_distributed_optimizer=False contradicts .*"
                                          r"distributed_data_parallel_config\.use_distributed_optimizer=True: they are "):
        parse_megatron_config({"optimizer": {"use_distributed_optimizer": False},
                               "distributed_data_parallel_config": {"use_distributed_optimizer": True}})
    on = {"overlap_grad_reduce": True}
    assert parse_megatron_config({"distributed_data_parallel_config": on}).distributed_data_parallel_config == on


def test_errors_name_policy_engine_cfg_when_the_options_came_from_there() -> None:
    from engine_megatron.engine import MegatronEngine
    from rl_core.config import PolicyConfig, parse_config

    def policy(options: dict) -> PolicyConfig:
        return parse_config(PolicyConfig, {"model_name": "unused", "engine": "megatron", "engine_cfg": options},
                            "policy")

    with pytest.raises(ConfigError, match=r"'policy\.engine_cfg\.tensor_model_paralel_size'.*did you mean "
                                          r"'policy\.engine_cfg\.tensor_model_parallel_size'"):
        MegatronEngine.validate_config(policy({"tensor_model_paralel_size": 2}))
    with pytest.raises(ConfigError, match=r"policy\.engine_cfg\.optimizer\.adam_beta3"):
        MegatronEngine.validate_config(policy({"optimizer": {"adam_beta3": 0.9}}))
    with pytest.raises(ConfigError, match=r"policy\.engine_cfg\.pipeline_model_parallel_size must be >= 1"):
        MegatronEngine.validate_config(policy({"pipeline_model_parallel_size": 0}))
    tp4 = policy({"tensor_model_parallel_size": 4})
    with pytest.raises(ConfigError, match=r"policy\.engine_cfg\.tensor_model_parallel_size=4 must divide"):
        resolve_settings(tp4, MegatronEngine.validate_config(tp4), tiny_config("qwen2"), world_size=4, use_cuda=False)


def test_transformer_keys_pass_through_and_user_wins() -> None:
    cfg = parse_megatron_config({"bias_dropout_fusion": False, "moe_aux_loss_coeff": 0.01})
    assert cfg.transformer_config == {"bias_dropout_fusion": False, "moe_aux_loss_coeff": 0.01}
    policy = make_policy("unused")
    settings = resolve_settings(policy, cfg, tiny_config("qwen2"), world_size=1, use_cuda=False)
    assert settings.transformer_overrides["moe_aux_loss_coeff"] == 0.01
    assert settings.transformer_overrides["gradient_accumulation_fusion"] is False


def _simulate_cuda(monkeypatch, *, te: bool, apex: bool) -> None:
    """CUDA present, with or without transformer-engine and apex (their import checks patched)."""
    from engine_megatron import config, model

    available = {"apply_rope_fusion": te, "gradient_accumulation_fusion": apex, "persist_layer_norm": apex,
                 "masked_softmax_fusion": apex, "bias_activation_fusion": True, "bias_dropout_fusion": True}
    monkeypatch.setattr(config, "available_fusions", lambda: dict(available))
    monkeypatch.setattr(model, "te_available", lambda: te)


def test_cuda_without_te_or_apex_enables_only_the_torch_fusions(monkeypatch) -> None:
    _simulate_cuda(monkeypatch, te=False, apex=False)
    hf = tiny_config("qwen2")
    packed = make_policy("x", sequence_packing={"enabled": True})
    gpu = resolve_settings(packed, parse_megatron_config({}), hf, 1, use_cuda=True)
    fusions = {k: gpu.transformer_overrides[k] for k in CUDA_FUSIONS}
    assert fusions == {"apply_rope_fusion": False, "gradient_accumulation_fusion": False,
                       "persist_layer_norm": False, "masked_softmax_fusion": False,
                       "bias_activation_fusion": True, "bias_dropout_fusion": True}
    assert gpu.attention == "local"  # the local spec: packed rows through PackedDotProductAttention
    assert "attention=local" in gpu.describe() and "apply_rope_fusion': False" in gpu.describe()
    # megatron-core accepts exactly these flags without TE/apex (it raises for apply_rope_fusion otherwise)
    from megatron.core.transformer.transformer_config import TransformerConfig

    TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, **fusions)
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.apply_rope_fusion=true needs transformer-engine "
                                          r">= 1\.4.*does not import.*apply_rope_fusion=false"):
        resolve_settings(packed, parse_megatron_config({"apply_rope_fusion": True}), hf, 1, use_cuda=True)
    with pytest.raises(ConfigError, match=r"gradient_accumulation_fusion=true needs apex"):
        resolve_settings(packed, parse_megatron_config({"gradient_accumulation_fusion": True}), hf, 1, True)
    with pytest.raises(ConfigError, match=r"context_parallel_size=2 needs CUDA and transformer-engine"):
        resolve_settings(packed, parse_megatron_config({"context_parallel_size": 2}), hf, 2, use_cuda=True)
    off = resolve_settings(packed, parse_megatron_config({"bias_activation_fusion": False}), hf, 1, use_cuda=True)
    assert off.transformer_overrides["bias_activation_fusion"] is False  # the user's key wins


def test_cuda_with_te_and_apex_enables_every_fusion_and_thd(monkeypatch) -> None:
    _simulate_cuda(monkeypatch, te=True, apex=True)
    hf = tiny_config("qwen2")
    gpu = resolve_settings(make_policy("x", sequence_packing={"enabled": True}),
                           parse_megatron_config({"tensor_model_parallel_size": 2, "sequence_parallel": False,
                                                  "context_parallel_size": 2}), hf, 4, True)
    assert not gpu.sequence_parallel and gpu.pack_multiple == 8
    assert all(gpu.transformer_overrides[k] for k in CUDA_FUSIONS)
    assert gpu.attention == "transformer_engine"


def test_fusion_asked_for_on_cpu_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"persist_layer_norm=true needs apex.*this machine has no CUDA"):
        resolve_settings(make_policy("x"), parse_megatron_config({"persist_layer_norm": True}), tiny_config("qwen2"),
                         1, use_cuda=False)


def test_available_fusions_matches_what_imports_here() -> None:
    """On this machine (no TE, no apex) only the torch-implemented fusions count as available."""
    import importlib.util

    from engine_megatron.config import available_fusions

    found = available_fusions()
    assert found["apply_rope_fusion"] == (importlib.util.find_spec("transformer_engine") is not None)
    assert found["gradient_accumulation_fusion"] == (importlib.util.find_spec("fused_weight_gradient_mlp_cuda")
                                                     is not None)
    assert found["bias_activation_fusion"] and found["bias_dropout_fusion"]


def test_automatic_settings() -> None:
    hf = tiny_config("qwen2")
    cpu = resolve_settings(make_policy("x"), parse_megatron_config({"tensor_model_parallel_size": 2}), hf, 2, False)
    assert cpu.sequence_parallel and cpu.seq_multiple == 2
    assert not any(cpu.transformer_overrides[k] for k in CUDA_FUSIONS)
    assert cpu.transformer_overrides["batch_p2p_comm"] is False


@pytest.mark.parametrize(
    ("megatron_cfg", "policy_kw", "world", "message"),
    [
        ({"tensor_model_parallel_size": 3}, {}, 3, r"tensor_model_parallel_size=3 must divide the model's attention heads"),
        ({"context_parallel_size": 2}, {}, 2, r"context_parallel_size=2 needs packed sequences.*sequence_packing\.enabled=true"),
        ({"tensor_model_parallel_size": 2}, {}, 3, r"world size 3 is not divisible by TP\*PP\*CP"),
        ({"expert_model_parallel_size": 2}, {}, 2, r"expert_model_parallel_size=2 must divide the number of experts \(none"),
        ({"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1}, {}, 2,
         r"expert_tensor_parallel_size=1 with tensor_model_parallel_size=2 needs expert_model_parallel_size > 1"),
    ],
)
def test_cross_field_errors(megatron_cfg, policy_kw, world, message) -> None:
    cfg = parse_megatron_config(megatron_cfg)
    arch = "qwen3_moe" if "expert_tensor_parallel_size" in megatron_cfg else "qwen2"
    with pytest.raises(ConfigError, match=message):
        resolve_settings(make_policy("x", **policy_kw), cfg, tiny_config(arch), world, use_cuda=False)


def test_expert_tensor_parallel_size_defaults_to_tp() -> None:
    """megatron's default: with EP=1 the experts are TP-sharded like the dense layers (their gradients are
    reduced as dense ones), so the layout TP=2, EP=1 of a MoE model resolves without a key."""
    assert parse_megatron_config({"tensor_model_parallel_size": 2}).etp == 2
    assert parse_megatron_config({"tensor_model_parallel_size": 2, "expert_model_parallel_size": 2,
                                  "expert_tensor_parallel_size": 1}).etp == 1
    resolve_settings(make_policy("x"), parse_megatron_config({"tensor_model_parallel_size": 2}),
                     tiny_config("qwen3_moe"), 2, use_cuda=False)


def _build(rank: int, world_size: int, ckpt: str, megatron_cfg: dict) -> str:
    from engine_megatron import engine

    def too_late(*args, **kwargs):
        raise AssertionError("the model was built (or converted) before the layout was checked")

    engine.build_ddp_model = engine.convert_once = too_late
    try:
        engine.MegatronEngine(make_policy(ckpt, megatron_cfg))
    except ConfigError as exc:
        return str(exc)
    return "built"


@pytest.mark.distributed
def test_engine_fails_early_on_bad_layout(tiny_ckpt) -> None:
    """A layout the world cannot hold fails in the constructor before the model is built or converted."""
    out = run_distributed(_build, world_size=2, args=(tiny_ckpt("llama"), {"tensor_model_parallel_size": 2,
                                                                            "pipeline_model_parallel_size": 2}))
    assert all("world size 2 is not divisible" in o for o in out), out


def test_missing_model_names_policy_model_name(tmp_path) -> None:
    """Before any process group: the key the user wrote, not the converter's CLI flag."""
    from engine_megatron.engine import MegatronEngine

    with pytest.raises(ValueError, match=r"config.json not found: policy.model_name must be a Hugging Face checkpoint"):
        MegatronEngine(make_policy(str(tmp_path / "nowhere")))


@pytest.mark.parametrize("options, packing, world_size, expected", [
    ({}, True, 1, 1), ({"tensor_model_parallel_size": 2}, False, 2, 2),
    ({"tensor_model_parallel_size": 2, "sequence_parallel": False}, False, 2, 1),
    ({"tensor_model_parallel_size": 2}, True, 2, 4), ({"sequence_parallel": True}, False, 1, 1),
    ({"tensor_model_parallel_size": 2, "context_parallel_size": 2}, True, 4, 8),
])
def test_sequence_multiple_from_the_config_is_the_one_the_planner_uses(monkeypatch, options, packing, world_size,
                                                                        expected) -> None:
    """The trainer's prompt-length limit rounds by `MegatronEngine.sequence_multiple` (config alone): it must be
    the multiple `batching.plan` gives seqpack once the settings are resolved."""
    from engine_megatron.engine import MegatronEngine

    _simulate_cuda(monkeypatch, te=True, apex=False)  # context parallelism needs TE
    policy = make_policy("x", sequence_packing={"enabled": packing}, megatron_cfg=options)
    settings = resolve_settings(policy, MegatronEngine.validate_config(policy), tiny_config("qwen2"), world_size,
                                use_cuda=True)
    planned = settings.pack_multiple if settings.packing else settings.seq_multiple  # as batching.plan
    assert MegatronEngine.sequence_multiple(policy) == planned == expected


@pytest.mark.parametrize(("arch", "hf_overrides", "megatron_cfg", "message"), [
    ("qwen3_moe", {}, {"tensor_model_parallel_size": 2, "sequence_parallel": False},
     r"sequence_parallel=false with tensor_model_parallel_size=2 on a model with experts"),
    ("qwen3_moe", {}, {"tensor_model_parallel_size": 2, "expert_tensor_parallel_size": 1},
     r"expert_tensor_parallel_size=1 with tensor_model_parallel_size=2 needs expert_model_parallel_size > 1"),
    ("mixtral", {"num_experts_per_tok": 1}, {}, r"num_experts_per_tok=1 and renormalised routing weights"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, {}, r"Qwen3-MoE with dense layers"),
    ("qwen2", {}, {"pipeline_model_parallel_size": 3}, r"pipeline_model_parallel_size=3 must divide"),
])
def test_check_model_refuses_what_the_workers_would(tmp_path, arch, hf_overrides, megatron_cfg, message) -> None:
    """What the engine found only in its workers (megatron's MoE layer at the first training step, the conversion
    at start-up), found by the trainer's preflight from config.json alone."""
    from engine_megatron.engine import MegatronEngine

    tiny_config(arch, **hf_overrides).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=message):
        MegatronEngine.check_model(make_policy(str(tmp_path), megatron_cfg))
    tiny_config("qwen3_moe", num_experts_per_tok=1, norm_topk_prob=False).save_pretrained(tmp_path)
    MegatronEngine.check_model(make_policy(str(tmp_path), {"tensor_model_parallel_size": 2}))  # megatron's router
