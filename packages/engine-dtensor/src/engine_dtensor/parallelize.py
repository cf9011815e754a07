"""How a Hugging Face causal LM is parallelised: TP plans, activation checkpointing, compile, FSDP2.

Each `apply_*` takes `(model, mesh, cfg)`, mutates the model in place and returns None; `parallelize`
calls them in a fixed order. The HF model code is never edited: TP is expressed as DTensor
`parallelize_module` plans keyed by module path (a LoRA-adapted linear: `LoRAParallel`). Does not own
process groups or the mesh layout (parallel_dims.py) nor the forward pass (forward.py).
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from engine_dtensor.config import DTensorConfig
from engine_dtensor.parallel_dims import ParallelDims

logger = logging.getLogger(__name__)

# Dense decoder families whose HF module layout the TP plan below matches (qk-norm handled for qwen3).
TP_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# Wrapper prefixes that apply_ac / apply_compile / lora.apply_lora (LoRALinear's base_layer) add to parameter
# names; HF names have none of them.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "base_layer.")


def hf_name(name: str) -> str:
    """A parameter name of the parallelised model as Hugging Face spells it."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The ModuleList of decoder layers of an HF `*ForCausalLM` (model.model.layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__} has no `model.layers` ModuleList; the DTensor engine supports HF "
            "decoder-only *ForCausalLM models (Llama, Qwen2/3, Mistral, Mixtral, Qwen3-MoE)"
        )
    return layers


class HeadShardedNorm(ParallelStyle):
    """A norm over head_dim applied to TP-local attention heads (Qwen3 q_norm / k_norm).

    Its weight becomes a Replicate DTensor and its input a DTensor sharded on the heads dim, so the
    weight gradient comes out Partial and is summed over the TP group (each rank sees only its heads).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def replicate_params(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, param in list(mod.named_parameters(recurse=False)):
                dist_param = nn.Parameter(distribute_tensor(param, mesh, [Replicate()]))
                mod.register_parameter(pname, dist_param)

        def to_dtensor(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            # (B, S, heads_local, head_dim): heads are dim 2
            return (DTensor.from_local(inputs[0], mesh, [Shard(2)], run_check=False), *inputs[1:])

        def to_local(mod: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
            return output.to_local()

        return distribute_module(module, device_mesh, replicate_params, to_dtensor, to_local)


class LoRAParallel(ParallelStyle):
    """TP of a LoRALinear (lora.py) as one module, given the style its base linear would get alone.

    The module's forward, base(x) + scaling * lora_B(lora_A(dropout(x))), runs on DTensors: the base style's
    input hook makes x a DTensor (Replicate for colwise, Shard(-1) for rowwise) and its output hook redistributes
    the sum to the base style's output layout, so both terms leave the module in one layout and the rowwise
    reduction (all-reduce, or reduce-scatter under SP) is one collective for both. The adapters are sharded so
    that DTensor propagation gives their term the base term's placement:
    - colwise base (weight Shard(0), output features sharded): A Replicate, B Shard(0); A's output (B, S, r) is
      replicated, B's is Shard(-1) like the base's. A's gradient comes out Partial (each rank back-propagates its
      output features only) and is summed over TP when FSDP2 redistributes it to A's Replicate placement.
    - rowwise base (weight Shard(1), input features sharded): A Shard(1), B Replicate; A's output is Partial like
      the base's, B keeps it Partial, and the output hook reduces base and adapter terms together.
    (Adapters as separate plan entries would each convert between local tensors and DTensors on their own, and
    the rowwise A's Partial output would need a reduction of its own before B.)"""

    def __init__(self, base_style: ColwiseParallel | RowwiseParallel) -> None:
        super().__init__()
        self.base_style = base_style
        if isinstance(base_style, ColwiseParallel):
            self.weight_placements: dict[str, Placement] = {"base_layer": Shard(0), "lora_A": Replicate(),
                                                            "lora_B": Shard(0)}
            self.desired_input_layouts: tuple[Placement, ...] = (Replicate(),)
        else:
            self.weight_placements = {"base_layer": Shard(1), "lora_A": Shard(1), "lora_B": Replicate()}
            self.desired_input_layouts = (Shard(-1),)

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        weight_placement = self.weight_placements.get(name)
        if weight_placement is None:  # the LoRALinear itself, its dropout
            return
        for pname, param in list(module.named_parameters(recurse=False)):
            # a bias (the base's) is sharded where the output features are, else replicated (as torch's styles)
            placement = weight_placement if pname == "weight" or weight_placement == Shard(0) else Replicate()
            dist_param = nn.Parameter(distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad)
            module.register_parameter(pname, dist_param)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        style = self.base_style
        # torch's own input / output hooks of the base style (static methods): the same layouts as a plain linear
        return distribute_module(
            module,
            device_mesh,
            self._partition,
            partial(style._prepare_input_fn, style.input_layouts, self.desired_input_layouts),
            partial(style._prepare_output_fn, style.output_layouts, style.use_local_output),
        )


def _layer_plan(layer: nn.Module, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Megatron-style column/row split of attention and MLP; with SP, norms work on sequence shards."""
    residual = Shard(1) if sequence_parallel else Replicate()
    plan: dict[str, ParallelStyle] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=residual),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=residual),
    }
    # a linear with a LoRA adapter (lora.LoRALinear: apply_lora runs before TP) is parallelised as one module
    plan = {name: style if isinstance(layer.get_submodule(name), nn.Linear) else LoRAParallel(style)
            for name, style in plan.items()}
    if hasattr(layer.self_attn, "q_norm"):
        plan["self_attn.q_norm"] = HeadShardedNorm()
        plan["self_attn.k_norm"] = HeadShardedNorm()
    if sequence_parallel:
        plan.update(
            {
                "input_layernorm": SequenceParallel(use_local_output=True),
                "post_attention_layernorm": SequenceParallel(use_local_output=True),
                # attention and MLP need the whole sequence: all-gather it on the way in
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            }
        )
    return plan


def check_tp_supported(model: nn.Module, tp: int) -> None:
    """ValueError unless the model has a TP plan here that `tp` divides (the engine's check_model calls it on the
    meta model, before any worker starts)."""
    config = model.config
    if config.model_type not in TP_MODEL_TYPES:
        raise ValueError(
            f"policy.dtensor_cfg.tensor_parallel_size={tp} is not supported for model_type "
            f"'{config.model_type}' (TP plans exist for {list(TP_MODEL_TYPES)}); use tensor_parallel_size=1 "
            "(FSDP only)"
        )
    if getattr(config, "tie_word_embeddings", False):
        raise ValueError(
            "tensor parallelism with tied input/output embeddings is not supported; use "
            "policy.dtensor_cfg.tensor_parallel_size=1"
        )
    for key in ("num_attention_heads", "num_key_value_heads"):
        if getattr(config, key) % tp:
            raise ValueError(
                f"{key}={getattr(config, key)} is not divisible by policy.dtensor_cfg.tensor_parallel_size={tp}"
            )


def apply_tp(model: nn.Module, mesh: DeviceMesh, cfg: DTensorConfig) -> None:
    """Shard attention heads, MLP columns and the vocabulary (embedding, lm_head) over `mesh` (tp)."""
    check_tp_supported(model, mesh.size())
    sp = cfg.sequence_parallel
    top_plan: dict[str, ParallelStyle] = {
        # vocab-sharded embedding; with SP its output is reduce-scattered over the sequence
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate()
        ),
        # logits stay vocab-sharded (a DTensor): logprobs are computed vocab-parallel, never gathered
        "lm_head": ColwiseParallel(
            input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1), use_local_output=False
        ),
    }
    if sp:
        top_plan["model.norm"] = SequenceParallel(use_local_output=True)
    # SequenceParallel and HeadShardedNorm make new Parameters that require grad: LoRA's frozen norms would train
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, mesh, top_plan)
    for layer in decoder_layers(model):
        parallelize_module(layer, mesh, _layer_plan(layer, sp))
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def apply_ac(model: nn.Module, cfg: DTensorConfig) -> None:
    """Recompute each decoder layer in backward (full-layer checkpointing)."""
    layers = decoder_layers(model)
    # LoRA dropout: the recomputation must draw the masks of the forward again (else the gradient is of another mask)
    preserve_rng_state = cfg.lora_cfg.enabled and cfg.lora_cfg.dropout > 0
    for i, layer in enumerate(layers):
        # non-reentrant: works with FSDP2 hooks and keyword arguments (HF layers take kwargs)
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=preserve_rng_state)


def apply_compile(model: nn.Module) -> None:
    """torch.compile each decoder layer in place (names unchanged).

    Dynamic shapes from the start: packed rows change length every micro-batch, and with automatic dynamic
    shapes each new length (and max length) recompiled at first."""
    for layer in decoder_layers(model):
        layer.compile(dynamic=True)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, cfg: DTensorConfig) -> None:
    """FSDP2 over `mesh` (dp): one unit per decoder layer plus the root (embeddings, norm, lm_head)."""
    param_dtype = torch.bfloat16 if cfg.precision == "bfloat16" else torch.float32
    # params are kept in fp32 (the optimizer's master copy); compute in param_dtype, reduce in fp32
    kwargs = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
    }
    if cfg.cpu_offload:
        # pinned host memory needs CUDA; on a CPU-only run the policy still exercises the same code path
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    # Losses are already divided by global-batch normalisers: DP gradients must be summed, not averaged.
    # Plain SUM collectives: the default pre-multiplied sum (PREMUL_SUM) does not exist in gloo. On one rank
    # FSDP neither reduces nor divides, and a divide factor of 1.0 would cost a pass over every gradient.
    if mesh.size() == 1:
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def parallelize(model: nn.Module, parallel_dims: ParallelDims, cfg: DTensorConfig) -> None:
    """Apply TP, AC, compile and FSDP in this order (each needs the previous one's module structure)."""
    # 1. TP first: FSDP then shards the TP-local DTensors along dp (2-D params).
    if parallel_dims.tp_enabled:
        apply_tp(model, parallel_dims.get_mesh("tp"), cfg)
    # 2. AC wraps whole decoder layers, so FSDP's per-layer hooks sit outside the recomputed region.
    if cfg.activation_checkpointing:
        apply_ac(model, cfg)
    # 3. Compile after AC wrapping, before FSDP (FSDP's hooks stay outside the compiled graphs).
    if cfg.compile:
        apply_compile(model)
    # 4. FSDP always, even on one rank: it is what applies mixed precision and CPU offload.
    apply_fsdp(model, parallel_dims.get_mesh("dp"), cfg)
    logger.info(
        "parallelized %s: dp=%d tp=%d sp=%s ac=%s compile=%s precision=%s",
        type(model).__name__,
        parallel_dims.dp,
        parallel_dims.tp,
        cfg.sequence_parallel,
        cfg.activation_checkpointing,
        cfg.compile,
        cfg.precision,
    )
