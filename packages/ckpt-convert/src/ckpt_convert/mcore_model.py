"""HF config -> megatron-core model config: `MCoreModelConfig` and `mcore_model_config()`.

Owns the architecture mapping (which TransformerConfig fields an HF config implies). It does not own
weights (mapping.py), files (convert.py) or building the model: the megatron engine builds its GPTModel
from `mcore_model_config(load_hf_config(path), tp=..., ...)` (`engine_megatron.model.build_gpt_model`),
so engine and converter agree on every field.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM"}
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
QK_NORM_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
VOCAB_DIVISIBLE_BY = 128


@dataclass(kw_only=True)
class MCoreModelConfig:
    """Everything needed to build a megatron GPTModel equivalent to an HF checkpoint."""

    transformer_config: Any  # megatron.core.transformer.TransformerConfig
    vocab_size: int  # padded: a multiple of VOCAB_DIVISIBLE_BY * tp
    hf_vocab_size: int
    max_sequence_length: int
    rotary_base: float
    rope_scaling: bool = False  # llama3-style frequency scaling
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_position_embeddings: int = 8192
    share_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "rope"
    arch: str = "LlamaForCausalLM"
    pad_token_id: int | None = None  # HF's embedding (padding_idx) gives its row no gradient from the lookup
    extra: dict = field(default_factory=dict)

    @property
    def is_moe(self) -> bool:
        return self.arch in MOE_ARCHITECTURES


def read_json(path: Path) -> Any:
    """A JSON file's content; ValueError naming the file when it is not JSON."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc}); restore it from the source checkpoint") from exc


def load_hf_config(hf_dir: str | os.PathLike, source: str = "--hf") -> Any:
    """Read `hf_dir/config.json` as a transformers config; error if the architecture is not supported.
    `source` names where `hf_dir` came from (a CLI flag, a config key) in the error."""
    from transformers import AutoConfig

    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        hint = "" if Path(hf_dir).exists() else (f"; no directory {hf_dir} here, and nothing is downloaded: fetch a "
                                                 f"Hugging Face Hub model first (hf download MODEL_ID --local-dir DIR)")
        raise ValueError(f"{path} not found: {source} must be a Hugging Face checkpoint directory with config.json"
                         f"{hint}")
    raw = read_json(path)
    arch = hf_architecture(raw)
    config = AutoConfig.from_pretrained(str(hf_dir))
    config.architectures = [arch]
    return config


def hf_architecture(config: Any) -> str:
    """The supported architecture name of an HF config (object or dict), or a ValueError listing them."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    archs = get("architectures") or []
    arch = archs[0] if archs else _MODEL_TYPES.get(get("model_type"), get("model_type"))
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} (config.json 'architectures') is not supported; "
                         f"supported: {list(SUPPORTED_ARCHITECTURES)}")
    return arch


def _rope_fields(hf: Any) -> dict:
    """rope theta and llama3 scaling from `rope_parameters` (transformers 5) or `rope_scaling`/`rope_theta`."""
    params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    out = {"rotary_base": float(theta)}
    if rope_type == "llama3":
        out.update(rope_scaling=True, rope_scaling_factor=float(params["factor"]),
                   rope_low_freq_factor=float(params.get("low_freq_factor", 1.0)),
                   rope_high_freq_factor=float(params.get("high_freq_factor", 4.0)),
                   rope_original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)))
    elif rope_type not in ("default", None):
        raise ValueError(f"rope_type={rope_type!r} in the HF config is not supported; supported: default, llama3")
    return out


def _check_divisible(hf: Any, heads: int, groups: int, tp: int, ep: int, num_experts: int | None) -> None:
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", groups)):
        if value % tp:
            ok = [d for d in range(1, groups + 1) if heads % d == 0 and groups % d == 0]
            raise ValueError(f"tp={tp} does not divide {name}={value}; choose --tp from {ok}")
    if num_experts is not None and num_experts % ep:
        ok = [d for d in range(1, num_experts + 1) if num_experts % d == 0]
        raise ValueError(f"ep={ep} does not divide the {num_experts} experts; choose --ep from {ok}")
    if num_experts is None and ep != 1:
        raise ValueError(f"ep={ep} needs a MoE model; {type(hf).__name__} is dense: use --ep 1")


def _check_overrides(overrides: dict, names: set[str]) -> None:
    for key in overrides:
        if key not in names:
            close = difflib.get_close_matches(key, sorted(names), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"override {key!r} is not a TransformerConfig field{hint}")


def _moe_fields(hf: Any, arch: str) -> dict:
    if arch == "Qwen3MoeForCausalLM":
        if getattr(hf, "mlp_only_layers", None) or getattr(hf, "decoder_sparse_step", 1) != 1:
            raise ValueError("Qwen3-MoE with dense layers (mlp_only_layers / decoder_sparse_step != 1) is not "
                             "supported: every layer must be a MoE layer")
        num_experts, ffn = hf.num_experts, hf.moe_intermediate_size
        # norm_topk_prob: softmax over all experts then renormalise the top-k == softmax over the top-k.
        pre_softmax = not getattr(hf, "norm_topk_prob", False)
    else:  # Mixtral: top-k on the logits, softmax over the k selected
        num_experts, ffn, pre_softmax = hf.num_local_experts, hf.intermediate_size, False
    if hf.num_experts_per_tok == 1 and not pre_softmax:
        # top-1 renormalised weighs the chosen expert 1.0; megatron takes a top-1 only after a softmax over all
        # experts (a softmax over one logit has no gradient) and weighs it by its probability: another model
        raise ValueError(f"{arch} with num_experts_per_tok=1 and renormalised routing weights (the chosen expert "
                         "weighted 1.0) has no megatron equivalent: megatron routes top-1 only after a softmax over "
                         "all experts, weighting the expert by its probability")
    return dict(num_moe_experts=num_experts, moe_router_topk=hf.num_experts_per_tok, moe_ffn_hidden_size=ffn,
                moe_router_pre_softmax=pre_softmax, moe_grouped_gemm=False,
                moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0, moe_router_dtype="fp32")


def _attention_bias(hf: Any, arch: str) -> bool:
    """Qwen2 has q/k/v biases (no o_proj bias); megatron cannot express an o_proj-only or MLP bias."""
    if getattr(hf, "attention_bias", False) or getattr(hf, "mlp_bias", False):
        raise ValueError(f"{arch} with attention_bias/mlp_bias=True is not supported (megatron's "
                         "add_bias_linear would add biases to every linear layer)")
    return arch == "Qwen2ForCausalLM"


def _sliding_window(hf: Any, arch: str) -> int | None:
    """The attention window of every layer, None for full attention. HF applies `sliding_window` to every
    layer unless the config lists `layer_types` (Qwen2/Qwen3: sliding only from `max_window_layers` on);
    megatron's `window_size` is one for all layers, so a mix is refused rather than silently dropped."""
    window = getattr(hf, "sliding_window", None)
    kinds = set(getattr(hf, "layer_types", None) or ["sliding_attention"])
    if not window or kinds == {"full_attention"}:
        return None
    if kinds != {"sliding_attention"}:
        raise ValueError(f"{arch} with layer_types mixing full and sliding-window attention (sliding_window="
                         f"{window}, max_window_layers={getattr(hf, 'max_window_layers', None)}): megatron applies one "
                         "window to every layer; not supported")
    return int(window)


def mcore_model_config(hf_config: Any, *, tp: int = 1, pp: int = 1, ep: int = 1, etp: int | None = None, cp: int = 1,
                       sequence_parallel: bool = False, params_dtype: torch.dtype = torch.float32,
                       overrides: dict | None = None, vocab_size: int | None = None) -> MCoreModelConfig:
    """Map an HF config to the megatron TransformerConfig and GPTModel arguments of the same model.

    `vocab_size` fixes the padded vocabulary (e.g. the one recorded in a converted checkpoint, so a model
    converted at one TP loads at another); by default it is hf vocab rounded up to a multiple of 128 * tp.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = hf_architecture(hf_config)
    hf = hf_config
    overrides = dict(overrides or {})
    _check_overrides(overrides, {f.name for f in dataclasses.fields(TransformerConfig)})
    heads, groups = hf.num_attention_heads, hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // heads
    moe = _moe_fields(hf, arch) if arch in MOE_ARCHITECTURES else {}
    _check_divisible(hf, heads, groups, tp, ep, moe.get("num_moe_experts"))
    if hf.num_hidden_layers % pp:
        raise ValueError(f"pp={pp} does not divide num_hidden_layers={hf.num_hidden_layers}; choose a divisor")
    fields: dict[str, Any] = dict(
        num_layers=hf.num_hidden_layers, hidden_size=hf.hidden_size, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=head_dim, ffn_hidden_size=hf.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf.rms_norm_eps, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False,
        add_qkv_bias=_attention_bias(hf, arch), qk_layernorm=arch in QK_NORM_ARCHITECTURES,
        hidden_dropout=0.0, attention_dropout=float(getattr(hf, "attention_dropout", 0.0) or 0.0),
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16, use_cpu_initialization=not torch.cuda.is_available(),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp or tp, context_parallel_size=cp, sequence_parallel=sequence_parallel,
        **moe,
    )
    window = _sliding_window(hf, arch)
    if window:  # HF: query i sees keys j with i - j < sliding_window; megatron's window is (left, right) inclusive
        fields["window_size"] = (window - 1, 0)
    fields.update(overrides)
    pad_to = VOCAB_DIVISIBLE_BY * tp
    if vocab_size is None:
        vocab_size = -(-hf.vocab_size // pad_to) * pad_to
    elif vocab_size < hf.vocab_size or vocab_size % tp:
        raise ValueError(f"vocab_size={vocab_size} must be >= the HF vocab_size={hf.vocab_size} and divisible "
                         f"by tp={tp}; leave it unset to pad to a multiple of {pad_to}")
    return MCoreModelConfig(
        transformer_config=TransformerConfig(**fields),
        vocab_size=vocab_size, hf_vocab_size=hf.vocab_size,
        max_sequence_length=hf.max_position_embeddings,
        share_embeddings_and_output_weights=bool(getattr(hf, "tie_word_embeddings", False)),
        position_embedding_type="rope", arch=arch, pad_token_id=getattr(hf, "pad_token_id", None), **_rope_fields(hf))
