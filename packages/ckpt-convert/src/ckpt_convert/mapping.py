"""HF <-> megatron-core tensor names and layouts, one tensor at a time.

An mcore name here is a GPTModel parameter name with the GLOBAL layer index and, for experts, the GLOBAL
expert index (`decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight`); the engine adds its
pipeline layer offset and EP expert offset before calling. Both layer-spec spellings are accepted:
the local spec's separate norms (`input_layernorm.weight`, `pre_mlp_layernorm.weight`) and the Transformer
Engine spec's fused ones (`self_attention.linear_qkv.layer_norm_weight`, `mlp.linear_fc1.layer_norm_weight`);
names are normalised to the TE spelling, which is also the key megatron's sharded_state_dict uses.

A full mcore tensor is the global (TP-gathered) tensor in megatron's checkpoint layout:
- linear_qkv: rows grouped per query group: [q heads of group 0, k0, v0, q heads of group 1, k1, v1, ...];
- linear_fc1: [gate; up] (with TP>1 each rank holds [gate_r; up_r]: use `merge_tp_shards`, not torch.cat);
- embedding / output layer: vocab padded to MCoreModelConfig.vocab_size with zero rows.
This module owns layouts only; files are convert.py's.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ckpt_convert.mcore_model import MCoreModelConfig

logger = logging.getLogger(__name__)

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class _Rule:
    mcore: str  # suffix after decoder.layers.{i}. (or the full name for non-layer tensors)
    hf: tuple[str, ...]  # HF name templates ({i}: layer, {e}: expert)
    kind: str  # copy | qkv | fc1 | vocab


def _moe_hf(cfg: MCoreModelConfig) -> tuple[str, str, tuple[str, str, str]]:
    """(HF prefix of the MoE block, router name, expert gate/up/down names) of the architecture."""
    if cfg.arch == "MixtralForCausalLM":
        return "block_sparse_moe", "gate", ("w1", "w3", "w2")
    return "mlp", "gate", ("gate_proj", "up_proj", "down_proj")


def _layer_rules(cfg: MCoreModelConfig) -> list[_Rule]:
    tc = cfg.transformer_config
    lay = "model.layers.{i}."
    att = lay + "self_attn."
    rules = [
        _Rule("self_attention.linear_qkv.layer_norm_weight", (lay + "input_layernorm.weight",), "copy"),
        _Rule("self_attention.linear_qkv.weight", tuple(att + f"{p}_proj.weight" for p in "qkv"), "qkv"),
        _Rule("self_attention.linear_proj.weight", (att + "o_proj.weight",), "copy"),
    ]
    if tc.add_qkv_bias:
        rules.append(_Rule("self_attention.linear_qkv.bias", tuple(att + f"{p}_proj.bias" for p in "qkv"), "qkv"))
    if tc.qk_layernorm:
        rules += [_Rule("self_attention.q_layernorm.weight", (att + "q_norm.weight",), "copy"),
                  _Rule("self_attention.k_layernorm.weight", (att + "k_norm.weight",), "copy")]
    if not cfg.is_moe:
        mlp = lay + "mlp."
        return rules + [
            _Rule("mlp.linear_fc1.layer_norm_weight", (lay + "post_attention_layernorm.weight",), "copy"),
            _Rule("mlp.linear_fc1.weight", (mlp + "gate_proj.weight", mlp + "up_proj.weight"), "fc1"),
            _Rule("mlp.linear_fc2.weight", (mlp + "down_proj.weight",), "copy"),
        ]
    block, router, (gate, up, down) = _moe_hf(cfg)
    moe = f"{lay}{block}."
    return rules + [
        _Rule("pre_mlp_layernorm.weight", (lay + "post_attention_layernorm.weight",), "copy"),
        _Rule("mlp.router.weight", (f"{moe}{router}.weight",), "copy"),
        _Rule("mlp.experts.local_experts.{e}.linear_fc1.weight",
              (moe + "experts.{e}." + gate + ".weight", moe + "experts.{e}." + up + ".weight"), "fc1"),
        _Rule("mlp.experts.local_experts.{e}.linear_fc2.weight", (moe + "experts.{e}." + down + ".weight",), "copy"),
    ]


def _global_rules(cfg: MCoreModelConfig) -> list[_Rule]:
    rules = [_Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab"),
             _Rule("decoder.final_layernorm.weight", ("model.norm.weight",), "copy")]
    if not cfg.share_embeddings_and_output_weights:
        rules.append(_Rule("output_layer.weight", ("lm_head.weight",), "vocab"))
    return rules


def canonical_name(cfg: MCoreModelConfig, name: str) -> str:
    """Normalise a GPTModel parameter name: strip DDP/Float16 `module.` prefixes, use the TE norm names."""
    while name.startswith("module."):
        name = name[len("module."):]
    match = _LAYER_RE.match(name)
    if not match:
        return name
    layer, rest = match.groups()
    if rest == "input_layernorm.weight":
        rest = "self_attention.linear_qkv.layer_norm_weight"
    elif rest == "pre_mlp_layernorm.weight" and not cfg.is_moe:
        rest = "mlp.linear_fc1.layer_norm_weight"
    elif rest == "mlp.linear_fc1.layer_norm_weight" and cfg.is_moe:
        rest = "pre_mlp_layernorm.weight"  # local-spec MoE checkpoints store the norm under this key
    return f"decoder.layers.{layer}.{rest}"


def _resolve(cfg: MCoreModelConfig, name: str) -> tuple[_Rule, dict]:
    """The rule of a canonical mcore name and its template values {i, e}."""
    for rule in _global_rules(cfg):
        if rule.mcore == name:
            return rule, {}
    match = _LAYER_RE.match(name)
    if match:
        layer, rest = int(match.group(1)), match.group(2)
        values: dict = {"i": layer}
        expert = _EXPERT_RE.match(rest)
        if expert:
            values["e"] = int(expert.group(1))
            rest = f"mlp.experts.local_experts.{{e}}.{expert.group(2)}"
        num_layers = cfg.transformer_config.num_layers
        num_experts = cfg.transformer_config.num_moe_experts or 0
        for rule in _layer_rules(cfg):
            if rule.mcore == rest and layer < num_layers and values.get("e", 0) < max(num_experts, 1):
                return rule, values
    raise ValueError(f"mcore tensor {name!r} is not part of a {cfg.arch} GPTModel "
                     f"(expected names like {mcore_names(cfg)[:3]}...)")


def mcore_names(cfg: MCoreModelConfig) -> list[str]:
    """All canonical mcore tensor names of the model, layer by layer (embedding first, output layer last)."""
    first, *rest = _global_rules(cfg)
    names = [first.mcore]
    for i in range(cfg.transformer_config.num_layers):
        for rule in _layer_rules(cfg):
            experts = range(cfg.transformer_config.num_moe_experts) if "{e}" in rule.mcore else [0]
            names += [f"decoder.layers.{i}." + rule.mcore.format(e=e) for e in experts]
    return names + [r.mcore for r in rest]


def hf_names_for(cfg: MCoreModelConfig, mcore_name: str) -> list[str]:
    """The HF tensor names that make up one mcore tensor (in the order they are fused)."""
    rule, values = _resolve(cfg, canonical_name(cfg, mcore_name))
    return [t.format(**values) for t in rule.hf]


def _hf_shapes(cfg: MCoreModelConfig, rule: _Rule) -> list[tuple[int, ...]]:
    """Expected HF shapes of a rule's sources (checked on load, so a wrong checkpoint fails by name)."""
    tc = cfg.transformer_config
    hidden, d = tc.hidden_size, tc.kv_channels
    q, kv = tc.num_attention_heads * d, tc.num_query_groups * d
    ffn = tc.moe_ffn_hidden_size if "experts" in rule.mcore else tc.ffn_hidden_size
    table = {
        "self_attention.linear_qkv.layer_norm_weight": [(hidden,)],
        "self_attention.linear_qkv.weight": [(q, hidden), (kv, hidden), (kv, hidden)],
        "self_attention.linear_qkv.bias": [(q,), (kv,), (kv,)],
        "self_attention.q_layernorm.weight": [(d,)], "self_attention.k_layernorm.weight": [(d,)],
        "self_attention.linear_proj.weight": [(hidden, q)],
        "mlp.linear_fc1.layer_norm_weight": [(hidden,)], "pre_mlp_layernorm.weight": [(hidden,)],
        "mlp.linear_fc1.weight": [(ffn, hidden)] * 2, "mlp.linear_fc2.weight": [(hidden, ffn)],
        "mlp.router.weight": [(tc.num_moe_experts or 0, hidden)],
        "mlp.experts.local_experts.{e}.linear_fc1.weight": [(ffn, hidden)] * 2,
        "mlp.experts.local_experts.{e}.linear_fc2.weight": [(hidden, ffn)],
        "embedding.word_embeddings.weight": [(cfg.hf_vocab_size, hidden)],
        "output_layer.weight": [(cfg.hf_vocab_size, hidden)], "decoder.final_layernorm.weight": [(hidden,)],
    }
    return table[rule.mcore]


def _fuse_qkv(cfg: MCoreModelConfig, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    tc = cfg.transformer_config
    groups, d = tc.num_query_groups, tc.kv_channels
    tail = q.shape[1:]  # (H,) for weights, () for biases
    q_g = q.reshape(groups, -1, *tail)  # (G, heads_per_group * d, ...)
    k_g, v_g = k.reshape(groups, d, *tail), v.reshape(groups, d, *tail)
    return torch.cat([q_g, k_g, v_g], dim=1).reshape(-1, *tail)


def _split_qkv(cfg: MCoreModelConfig, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    tc = cfg.transformer_config
    groups, d = tc.num_query_groups, tc.kv_channels
    per_group_q = tc.num_attention_heads // groups * d
    tail = qkv.shape[1:]
    grouped = qkv.reshape(groups, per_group_q + 2 * d, *tail)
    q, k, v = torch.split(grouped, [per_group_q, d, d], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


def hf_to_mcore_tensor(cfg: MCoreModelConfig, mcore_name: str, hf_tensors: Mapping[str, Tensor]) -> Tensor:
    """Build one full mcore tensor from its HF sources (`hf_names_for`); checks names and shapes."""
    rule, values = _resolve(cfg, canonical_name(cfg, mcore_name))
    names = [t.format(**values) for t in rule.hf]
    missing = [n for n in names if n not in hf_tensors]
    if missing:
        raise ValueError(f"HF tensor(s) {missing} missing (needed for {mcore_name}); the checkpoint does not "
                         f"match its config.json ({cfg.arch}): re-export it or fix config.json")
    sources = [hf_tensors[n] for n in names]
    for name, tensor, shape in zip(names, sources, _hf_shapes(cfg, rule)):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"HF tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape} from "
                             f"config.json: the weights and config.json do not belong together")
    if rule.kind == "qkv":
        return _fuse_qkv(cfg, *sources)
    if rule.kind == "fc1":
        return torch.cat(sources, dim=0)
    if rule.kind == "vocab":
        pad = cfg.vocab_size - cfg.hf_vocab_size
        return torch.cat([sources[0], sources[0].new_zeros(pad, sources[0].shape[1])]) if pad else sources[0]
    return sources[0]


def mcore_to_hf_tensors(cfg: MCoreModelConfig, hf_config: Any, mcore_name: str,
                        full_tensor: Tensor) -> list[tuple[str, Tensor]]:
    """One full (TP-gathered, checkpoint-layout) mcore tensor -> its HF tensors (vocab unpadded)."""
    del hf_config  # everything needed is in cfg (kept for a stable engine-facing signature)
    rule, values = _resolve(cfg, canonical_name(cfg, mcore_name))
    names = [t.format(**values) for t in rule.hf]
    if rule.kind == "qkv":
        return list(zip(names, _split_qkv(cfg, full_tensor)))
    if rule.kind == "fc1":
        gate, up = torch.chunk(full_tensor, 2, dim=0)
        return [(names[0], gate.contiguous()), (names[1], up.contiguous())]
    if rule.kind == "vocab":
        return [(names[0], full_tensor[: cfg.hf_vocab_size].contiguous())]
    return [(names[0], full_tensor)]


def hf_to_mcore_tensors(cfg: MCoreModelConfig, hf_config: Any,
                        hf_tensors: Mapping[str, Tensor]) -> list[tuple[str, Tensor]]:
    """Every mcore tensor whose HF sources are all in `hf_tensors` (e.g. one layer); unknown HF names raise.

    Partially present groups are skipped (their other sources may come with the next shard); a tied
    `lm_head.weight` is accepted and ignored.
    """
    del hf_config
    wanted: dict[str, list[str]] = {n: hf_names_for(cfg, n) for n in mcore_names(cfg)}
    known = {h for hs in wanted.values() for h in hs}
    unknown = [n for n in hf_tensors if n not in known
               and not (n == "lm_head.weight" and cfg.share_embeddings_and_output_weights)]
    if unknown:
        raise ValueError(f"HF tensor(s) {unknown[:5]} are not part of a {cfg.arch} model with this config.json; "
                         "check the architecture and num_hidden_layers / num_experts in config.json")
    return [(name, hf_to_mcore_tensor(cfg, name, hf_tensors)) for name, hs in wanted.items()
            if all(h in hf_tensors for h in hs)]


# --- tensor-parallel layout -------------------------------------------------------------------------------


def tp_partition_dim(cfg: MCoreModelConfig, mcore_name: str) -> int | None:
    """The dim megatron splits this tensor along under TP (None: replicated)."""
    name = canonical_name(cfg, mcore_name)
    if name.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "word_embeddings.weight")) \
            or name == "output_layer.weight":
        return 0
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    return None


def split_tp_shard(cfg: MCoreModelConfig, mcore_name: str, full: Tensor, rank: int, size: int) -> Tensor:
    """This TP rank's local slice of a full tensor (gate and up halves of linear_fc1 split separately)."""
    dim = tp_partition_dim(cfg, mcore_name)
    if dim is None or size == 1:
        return full
    if canonical_name(cfg, mcore_name).endswith("linear_fc1.weight"):
        gate, up = torch.chunk(full, 2, dim=0)
        return torch.cat([torch.chunk(gate, size)[rank], torch.chunk(up, size)[rank]]).contiguous()
    return torch.chunk(full, size, dim=dim)[rank].contiguous()


def merge_tp_shards(cfg: MCoreModelConfig, mcore_name: str, shards: list[Tensor]) -> Tensor:
    """Inverse of `split_tp_shard`: the full tensor from all TP ranks' local tensors (in rank order)."""
    dim = tp_partition_dim(cfg, mcore_name)
    if dim is None or len(shards) == 1:
        return shards[0]
    if canonical_name(cfg, mcore_name).endswith("linear_fc1.weight"):
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(shards, dim=dim)
