"""The megatron model of an HF checkpoint: build, wrap in DDP, load converted weights, export HF tensors.

Owns the layer spec (Transformer Engine with CUDA, megatron's local modules otherwise) and
`build_gpt_model`, the conversion cache (an HF checkpoint is converted once through ckpt-convert into megatron's
dist_checkpointing format, keyed by path, mtime, dtype and TP/PP/EP), loading it into this rank's shard,
and `export_hf_tensors`, which rebuilds full tensors from TP/EP shards and pipeline stages and names them
the Hugging Face way (ckpt-convert's name maps). The architecture (TransformerConfig fields) comes from
ckpt-convert's `mcore_model_config`, so engine and converter agree on every field.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ckpt_convert.mcore_model import MCoreModelConfig
from engine_megatron import lora
from engine_megatron.config import LoRAConfig
from engine_megatron.parallel import ParallelRanks
from rl_core.lora import merge_named

logger = logging.getLogger(__name__)


def te_available() -> bool:
    """True when Transformer Engine can be used: CUDA present and TE importable."""
    if not torch.cuda.is_available() or importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken TE install means: use the local spec
        logger.warning("transformer_engine is installed but does not import; using the local layer spec")
        return False
    return True


def layer_spec(cfg: MCoreModelConfig, lora: bool = False) -> Any:
    """The layer spec, chosen once: Transformer Engine with CUDA, megatron's local modules otherwise
    (with `PackedDotProductAttention` as core attention: THD packed rows without TE). With `lora` always the local
    modules, their linears those of lora_layers.py: TE's linear_qkv / linear_fc1 fuse the input norm, and the
    adapters need the normalised input they see."""
    from megatron.core.models.gpt import gpt_layer_specs

    tc = cfg.transformer_config
    kwargs = dict(num_experts=tc.num_moe_experts, moe_grouped_gemm=tc.moe_grouped_gemm,
                  qk_layernorm=tc.qk_layernorm)
    if te_available() and not lora:
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**kwargs)
    if te_available():
        logger.info("LoRA: megatron's local layer spec, although transformer-engine is available (its fused "
                    "norm + linear hides the adapters' input)")
    from engine_megatron.packed_attention import PackedDotProductAttention, use_one_call_thd_rope

    use_one_call_thd_rope()
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=tc.normalization, **kwargs)
    # megatron's local DotProductAttention rejects THD packed_seq_params; this subclass takes them
    spec.submodules.self_attention.submodules.core_attention = PackedDotProductAttention
    if lora:
        _use_lora_linears(spec)
    return spec


def _use_lora_linears(spec: Any) -> None:
    """The local spec's four linears of a dense layer replaced by their LoRA subclasses (adapters come later)."""
    from engine_megatron.lora_layers import LoRAColumnParallelLinear, LoRARowParallelLinear

    attention, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp
    # megatron-core 0.19 wraps the MLP's spec as functools.partial(MLP.as_mlp_submodule, submodules=...)
    mlp = mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules
    attention.linear_qkv, attention.linear_proj = LoRAColumnParallelLinear, LoRARowParallelLinear
    mlp.linear_fc1, mlp.linear_fc2 = LoRAColumnParallelLinear, LoRARowParallelLinear


def build_gpt_model(cfg: MCoreModelConfig, *, pre_process: bool | None = None, post_process: bool | None = None,
                    vp_stage: int | None = None, lora_cfg: LoRAConfig | None = None) -> Any:
    """Build the megatron GPTModel for this rank (parallel_state must be initialised by the caller); with
    `lora_cfg`, adapters on its targets and the base frozen (lora_layers.apply_lora)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from engine_megatron.fallback_fixes import apply_fallback_fixes
    from engine_megatron.megatron_cpu import ensure_cpu_compat

    apply_fallback_fixes()  # megatron's own fallbacks without TE/apex, on any device
    ensure_cpu_compat()  # no-op with CUDA
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    model = GPTModel(
        config=cfg.transformer_config, transformer_layer_spec=layer_spec(cfg, lora_cfg is not None),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_sequence_length, pre_process=pre_process, post_process=post_process,
        share_embeddings_and_output_weights=cfg.share_embeddings_and_output_weights,
        position_embedding_type=cfg.position_embedding_type, rotary_base=cfg.rotary_base,
        rope_scaling=cfg.rope_scaling, rope_scaling_factor=cfg.rope_scaling_factor, vp_stage=vp_stage)
    if cfg.rope_scaling and hasattr(model, "rotary_pos_emb"):
        # GPTModel only forwards the llama3 `factor`; recompute inv_freq with all four HF parameters.
        rope = model.rotary_pos_emb
        dim = rope.inv_freq.numel() * 2
        base = 1.0 / (cfg.rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32,
                                                       device=rope.inv_freq.device) / dim))
        rope.inv_freq = rope._apply_scaling(
            base, factor=cfg.rope_scaling_factor, low_freq_factor=cfg.rope_low_freq_factor,
            high_freq_factor=cfg.rope_high_freq_factor,
            original_max_position_embeddings=cfg.rope_original_max_position_embeddings)
    if pre_process and cfg.pad_token_id is not None and 0 <= cfg.pad_token_id < cfg.hf_vocab_size:
        model.embedding.word_embeddings.register_forward_hook(_no_lookup_gradient_for(cfg.pad_token_id))
    if lora_cfg is not None:
        from engine_megatron.lora_layers import apply_lora

        apply_lora(model, cfg, lora_cfg)
    return model


def _no_lookup_gradient_for(token_id: int) -> Callable[..., Tensor]:
    """A forward hook on megatron's VocabParallelEmbedding: where the input is `token_id`, the output is detached,
    so its row gets no gradient from the lookup, as HF's `nn.Embedding(padding_idx=pad_token_id)` (llama, qwen2/3,
    mistral); a tied output layer still trains it. Megatron's embedding has no padding_idx: a sampled pad token
    trained the row, and the two engines drifted apart.

    The output is reduced over TP ranks ([b, s, h]) or, with sequence parallelism, reduce-scattered to this rank's
    chunk of the sequence ([s/tp, b, h]): detaching each rank's own pad positions zeroes them all in the backward."""
    def hook(module: Any, args: tuple[Tensor, ...], output: Tensor) -> Tensor:
        is_token = args[0] == token_id  # [b, s]
        if module.reduce_scatter_embeddings:
            chunk = output.shape[0]
            rank = module.tp_group.rank()
            is_token = is_token.transpose(0, 1)[rank * chunk : (rank + 1) * chunk]
        return torch.where(is_token[..., None], output.detach(), output)

    return hook


def build_ddp_model(model_cfg: Any, ddp_overrides: dict[str, Any], ranks: ParallelRanks,
                    lora_cfg: LoRAConfig | None = None) -> Any:
    """This rank's GPTModel stage wrapped in megatron's DistributedDataParallel (with `lora_cfg`: around the
    adapters only, the base frozen before the wrap)."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.transformer.module import Float16Module

    from engine_megatron.compat import device_context

    with device_context():
        module = build_gpt_model(model_cfg, pre_process=ranks.first_stage, post_process=ranks.last_stage,
                                 lora_cfg=lora_cfg)
        if torch.cuda.is_available():
            module.cuda()
        tf_config = module.config
        if tf_config.bf16 or tf_config.fp16:
            # megatron's mixed precision: half-precision params and activations, fp32 logits out of the
            # last stage; the optimizer keeps fp32 main params.
            module = Float16Module(tf_config, module)
        ddp_kwargs = dict(grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=True,
                          bucket_size=None)
        ddp_kwargs.update(ddp_overrides)
        model = DistributedDataParallel(config=tf_config, ddp_config=DistributedDataParallelConfig(**ddp_kwargs),
                                        module=module)
    # The schedules call this after the last backward: DP (and embedding/expert) grad all-reduce.
    tf_config.finalize_model_grads_func = finalize_model_grads
    if model.ddp_config.overlap_grad_reduce:
        # as megatron's own training loop: the schedules hold the bucket reduce back for all but the last
        # micro-batch (no_sync) and launch it during that one's backward (start_grad_sync); without these a
        # bucket is reduced at the first micro-batch and megatron fails when the step's last one finishes
        tf_config.no_sync_func = model.no_sync
        tf_config.grad_sync_func = model.start_grad_sync
    return model


def gpt_model(model: Any) -> Any:
    """The GPTModel inside the DDP (and Float16Module) wrappers: its names are the checkpoint's names."""
    while hasattr(model, "module"):
        model = model.module
    return model


_CONVERT_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp32"}


def conversion_cache_dir(hf_dir: str, cache_root: str | None, tp: int, pp: int, ep: int, dtype: str) -> Path:
    """Where the converted checkpoint of `hf_dir` lives: keyed by path, config.json, the weights' fingerprint
    (`rl_core.lora.base_model_fingerprint`: names, sizes, headers, first and last MiB), newest mtime, dtype and
    layout. The mtime alone missed new weights copied in with their old times (`cp -p`, `rsync -a`): the engine
    trained the previous conversion while the generator sampled the new weights."""
    from rl_core.lora import base_model_fingerprint

    src = Path(hf_dir).resolve()
    mtime = max((p.stat().st_mtime_ns for p in src.iterdir() if p.is_file()), default=0)
    config = hashlib.sha256((src / "config.json").read_bytes()).hexdigest()
    key = hashlib.sha256(f"{src}|{config}|{base_model_fingerprint(src)}|{mtime}|{dtype}|tp{tp}|pp{pp}|ep{ep}"
                         .encode()).hexdigest()[:16]
    root = Path(cache_root or os.environ.get("RL_STACK_CACHE", Path.home() / ".cache" / "rl-stack")) / "mcore-ckpt"
    return root / f"{src.name}-{key}"


def convert_once(hf_dir: str, cache_root: str | None, tp: int, pp: int, ep: int, dtype: str) -> Path:
    """Convert on global rank 0 unless cached (ckpt-convert writes atomically), then every rank waits.

    Where the cache is node-local (the default under ~/.cache on a multi-node run), the first rank of each
    other node then converts its node's copy; on a shared filesystem it exists by then and nothing runs twice.
    """
    from ckpt_convert.convert import convert_hf_to_mcore

    target = conversion_cache_dir(hf_dir, cache_root, tp, pp, ep, dtype)
    hosts: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    rank = dist.get_rank()
    for converts in (rank == 0, hosts.index(hosts[rank]) == rank):  # global rank 0, then each node's first
        if converts and not target.exists():
            logger.info("converting %s to megatron format at %s (cached for later runs)", hf_dir, target)
            convert_hf_to_mcore(hf_dir, target, tp=tp, pp=pp, ep=ep, dtype=_CONVERT_DTYPES[dtype])
        dist.barrier()
    return target


def load_converted(model: Any, ckpt_dir: Path) -> None:
    """dist_checkpointing.load of a converted checkpoint into this rank's shard (any TP/PP/EP); LoRA adapters
    keep their initial values (an HF checkpoint has none)."""
    from megatron.core import dist_checkpointing

    module = gpt_model(model)
    sharded = {key: value for key, value in module.sharded_state_dict().items() if not lora.is_adapter(key)}
    state = dist_checkpointing.load(sharded, str(ckpt_dir))
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and not lora.is_adapter(k)]
    if missing or unexpected:
        raise ValueError(f"checkpoint {ckpt_dir} does not match the model: missing {missing}, unexpected {unexpected}")


# ---- export: full tensors under HF names ----------------------------------------------------------------


def _global_name(module: Any, name: str, ranks: ParallelRanks, num_local_experts: int) -> str:
    """Local parameter name -> the name it has in a TP=PP=EP=1 model (global layer and expert ids)."""
    match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
    if match:
        layer = module.decoder.layers[int(match.group(1))]
        name = f"decoder.layers.{layer.layer_number - 1}.{match.group(2)}"
    return re.sub(r"local_experts\.(\d+)\.",
                  lambda m: f"local_experts.{ranks.ep_rank * num_local_experts + int(m.group(1))}.", name)


def _tp_gather(model_cfg: Any, param: Tensor, name: str) -> Tensor:
    """The full tensor of a tensor-parallel parameter from its shards (TP, or expert-TP for experts)."""
    from megatron.core import parallel_state as ps

    from ckpt_convert.mapping import merge_tp_shards

    if not getattr(param, "tensor_model_parallel", False):
        return param.detach()
    expert = not getattr(param, "allreduce", True)
    group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
    size = dist.get_world_size(group) if group is not None else 1
    if size == 1:
        return param.detach()
    shards = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    if lora.is_adapter(name):  # one HF module's factor: a plain shard of it
        return torch.cat(shards, dim=param.partition_dim)
    return merge_tp_shards(model_cfg, name, shards)  # fused gate/up shards are not a plain concat


def export_hf_tensors(model: Any, model_cfg: Any, hf_config: Any, ranks: ParallelRanks,
                      lora_scaling: float = 0.0) -> Iterator[tuple[str, Tensor]]:
    """Every full parameter under its HF name(s), one at a time, the same stream on every rank."""
    return hf_export(model, model_cfg, hf_config, ranks, lora_scaling)[1]


def hf_export(model: Any, model_cfg: Any, hf_config: Any, ranks: ParallelRanks,
              lora_scaling: float = 0.0) -> tuple[list[list[tuple[str, tuple[int, ...], torch.dtype]]],
                                                  Iterator[tuple[str, Tensor]]]:
    """(plan, stream): the HF (name, shape, dtype) of each mcore tensor in stream order, known before
    any data moves (what a streaming safetensors writer needs), and the stream of full tensors.

    A LoRA run's adapted weights are sent merged, W + lora_scaling * B @ A (rl_core.lora.merge: float32, rounded
    once), under the base weight's HF name, and the adapters not at all (`adapter_export`). The merge is done on
    the HF tensors of the gathered megatron weight, each with its own adapter: the same sums as on megatron's fused
    layout, entry by entry, and the DTensor engine's exactly."""
    from ckpt_convert.mapping import mcore_to_hf_tensors

    params = _GatheredParams(model, model_cfg, ranks)
    order = sorted((n for n in params.owners if not lora.is_adapter(n)), key=_export_order)
    adapters_of: dict[str, list[str]] = {}
    for name in params.owners:
        if lora.is_adapter(name):
            adapters_of.setdefault(lora.base_weight(name), []).append(name)
    plan = []
    for n in order:
        meta = torch.empty(params.owners[n][1], dtype=getattr(torch, params.owners[n][2]), device="meta")
        plan.append([(hf, tuple(t.shape), t.dtype) for hf, t in mcore_to_hf_tensors(model_cfg, hf_config, n, meta)])

    def stream() -> Iterator[tuple[str, Tensor]]:
        for n in order:
            tensors = mcore_to_hf_tensors(model_cfg, hf_config, n, params.full(n))
            adapters = {lora.hf_adapter_name(model_cfg, a): params.full(a) for a in adapters_of.get(n, [])}
            yield from merge_named(tensors, adapters, lora_scaling)

    return plan, stream()


def adapter_export(model: Any, model_cfg: Any, ranks: ParallelRanks) -> Iterator[tuple[str, Tensor]]:
    """(HF name, full tensor) of every LoRA adapter's A and B (peft's names without its prefix), one at a time;
    every rank must consume it."""
    params = _GatheredParams(model, model_cfg, ranks)
    for name in sorted((n for n in params.owners if lora.is_adapter(n)), key=_export_order):
        yield lora.hf_adapter_name(model_cfg, name), params.full(name)


class _GatheredParams:
    """The model's parameters under global names (TP=PP=EP=1 names; the tied output layer left out), and their
    full tensors on every rank, one collective at a time."""

    def __init__(self, model: Any, model_cfg: Any, ranks: ParallelRanks) -> None:
        module = gpt_model(model)
        num_local = (getattr(module.config, "num_moe_experts", None) or 0) // max(ranks.ep_size, 1)
        self.model_cfg = model_cfg
        self.local = {}
        for name, param in module.named_parameters():
            if name == "output_layer.weight" and module.share_embeddings_and_output_weights:
                continue  # tied: the embedding is the one exported
            self.local[_global_name(module, name, ranks, num_local)] = param
        # Agree on every name's owner (the lowest global rank holding it), full shape and dtype.
        mine = {n: (_full_shape(p), str(p.dtype).removeprefix("torch.")) for n, p in self.local.items()}
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (dist.get_rank(), mine))
        self.owners: dict[str, tuple[int, tuple[int, ...], str]] = {}
        for rank, names in sorted(everyone):
            for n, (shape, dtype) in names.items():
                self.owners.setdefault(n, (rank, shape, dtype))
        self.device = next(iter(self.local.values())).device

    def full(self, name: str) -> Tensor:
        """The full tensor `name` on the model's device (as DTensor's export: a refit to a generator on that GPU or
        over NCCL needs no round trip through the host), gathered over TP by its owner's TP group, broadcast to the
        others; writers copy to the host themselves."""
        owner, shape, dtype = self.owners[name]
        if name in self.local:  # every rank of the owner's TP group takes part in the gather
            full = _tp_gather(self.model_cfg, self.local[name], name).contiguous()
        else:
            full = torch.empty(shape, dtype=getattr(torch, dtype), device=self.device)
        if dist.get_world_size() > 1:
            dist.broadcast(full, src=owner)  # PP stages and EP ranks that do not hold it receive it
        return full


def _full_shape(param: Tensor) -> tuple[int, ...]:
    from megatron.core import parallel_state as ps

    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        expert = not getattr(param, "allreduce", True)
        size = (ps.get_expert_tensor_parallel_world_size() if expert else ps.get_tensor_model_parallel_world_size())
        shape[param.partition_dim] *= size
    return tuple(shape)


def _export_order(name: str) -> tuple:
    """Embedding first, then layers in order (experts by id), then the final norm and output layer."""
    layer = re.match(r"decoder\.layers\.(\d+)\.", name)
    expert = re.search(r"local_experts\.(\d+)\.", name)
    group = 0 if name.startswith("embedding") else 1 if layer else 2
    return (group, int(layer.group(1)) if layer else 0, int(expert.group(1)) if expert else -1, name)
