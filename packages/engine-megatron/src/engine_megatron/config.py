"""`policy.megatron_cfg`: the Megatron engine's own config section, and the settings derived from it.

Owns `MegatronConfig` (validated from the raw `policy.megatron_cfg` mapping with rl_core's validator),
the pass-through of every other key to megatron's `TransformerConfig` (checked against its fields), and
`resolve_settings`, which turns (policy, megatron_cfg, HF config, world size, device) into the concrete
settings the engine uses and logs: sequence parallel on with TP > 1, sequence padding for packing,
the fusions whose libraries import, TE or local attention (both take packed rows as THD), pipeline
communication that works under gloo. Does not build anything.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from rl_core import lora as shared_lora
from rl_core.config import ConfigError, PolicyConfig, describe_unknown_keys, parse_config

logger = logging.getLogger(__name__)

SECTION = "policy.megatron_cfg"
# TransformerConfig fusion flags -> what implements each one (named in the error when it is missing). A
# fusion is on by default exactly when CUDA is present and its library imports (megatron-core raises, or
# fails mid-run, otherwise: shared/notes/megatron-cpu-probe, issue 13).
FUSION_LIBRARIES = {
    "apply_rope_fusion": "transformer-engine >= 1.4",
    "gradient_accumulation_fusion": "apex built with --cuda_ext (module fused_weight_gradient_mlp_cuda)",
    "persist_layer_norm": "apex built with --cuda_ext (apex.contrib.layer_norm)",
    "masked_softmax_fusion": "apex built with --cuda_ext (modules scaled_masked_softmax_cuda, "
                             "scaled_upper_triang_masked_softmax_cuda)",
    "bias_activation_fusion": "CUDA (torch's jit-fused kernels)",
    "bias_dropout_fusion": "CUDA (torch's jit-fused kernels)",
}
CUDA_FUSIONS = tuple(FUSION_LIBRARIES)


def _imports(*modules: str) -> bool:
    try:
        for name in modules:
            importlib.import_module(name)
    except Exception:  # noqa: BLE001 - missing or broken (e.g. built for another torch): not usable
        return False
    return True


def _rope_fusion_available() -> bool:
    """megatron-core's own check (0.16 and 0.19): its TE rope functions are None without TE >= 1.4."""
    if not _imports("transformer_engine.pytorch"):
        return False
    from megatron.core.models.common.embeddings import rope_utils

    return rope_utils.fused_apply_rotary_pos_emb is not None or rope_utils.fused_apply_rotary_pos_emb_thd is not None


@functools.cache
def available_fusions() -> dict[str, bool]:
    """Which fusions' libraries import on this machine with CUDA (checked once per process)."""
    return {
        "apply_rope_fusion": _rope_fusion_available(),
        "gradient_accumulation_fusion": _imports("fused_weight_gradient_mlp_cuda"),
        "persist_layer_norm": _imports("apex.contrib.layer_norm.layer_norm"),
        "masked_softmax_fusion": _imports("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda"),
        "bias_activation_fusion": True,
        "bias_dropout_fusion": True,
    }


def attention_backend(use_cuda: bool, lora: bool = False) -> Literal["transformer_engine", "local"]:
    """The one decision between TE's layer spec (context parallelism) and megatron's local modules
    (`model.layer_spec` follows it); packed rows are THD `PackedSeqParams` for both. LoRA takes the local spec:
    TE's fused norm + linear hides the normalised input the adapters need."""
    from engine_megatron.model import te_available

    return "transformer_engine" if use_cuda and te_available() and not lora else "local"


@dataclass(kw_only=True)
class ActivationCheckpointingConfig:
    """Activation recompute (megatron's recompute_granularity / recompute_method / recompute_modules)."""

    enabled: bool = False
    granularity: Literal["full", "selective"] = "full"
    method: Literal["uniform", "block"] = "uniform"
    num_layers: int = 1
    modules: list[str] | None = None  # selective only, e.g. ["core_attn"]; megatron's default when None

    def transformer_kwargs(self) -> dict[str, Any]:
        if not self.enabled:
            return {}
        if self.granularity == "selective":
            out: dict[str, Any] = {"recompute_granularity": "selective"}
            if self.modules is not None:
                out["recompute_modules"] = list(self.modules)
            return out
        return {"recompute_granularity": "full", "recompute_method": self.method,
                "recompute_num_layers": self.num_layers}


@dataclass(kw_only=True)
class LoRAConfig(shared_lora.LoRAConfig):
    """`policy.megatron_cfg.lora_cfg`: the DTensor engine's LoRA (rl_core.lora: same keys, same adapters on the same
    HF modules), built on megatron's fused linears by lora_layers.py."""

    key: ClassVar[str] = "policy.megatron_cfg.lora_cfg"


@dataclass(kw_only=True)
class MegatronConfig:
    """`policy.megatron_cfg` (NeMo-RL's layout); keys not listed here go to megatron's TransformerConfig."""

    enabled: bool = True
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: = TP (megatron's default)
    sequence_parallel: bool | None = None  # None: on exactly when TP > 1
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    optimizer: dict[str, Any] = field(default_factory=dict)  # megatron OptimizerConfig overrides
    scheduler: dict[str, Any] = field(default_factory=dict)  # OptimizerParamScheduler overrides
    distributed_data_parallel_config: dict[str, Any] = field(default_factory=dict)
    seed: int = 1234
    converted_checkpoint_dir: str | None = None  # cache of HF -> megatron conversions; None: ~/.cache
    lora_cfg: LoRAConfig = field(default_factory=LoRAConfig)
    transformer_config: dict[str, Any] = field(default_factory=dict)  # filled from the unknown keys

    def __post_init__(self) -> None:
        lora = self.lora_cfg
        if lora.enabled and lora.dropout > 0 and self.tensor_model_parallel_size > 1:
            # a replicated adapter input needs one mask on every TP rank (megatron's CUDA RNG tracker would give
            # it; untested here), and on the CPU each rank draws its own: as in the DTensor engine, refused
            raise ConfigError(f"{lora.key}.dropout={lora.dropout} is not supported with tensor_model_parallel_size="
                              f"{self.tensor_model_parallel_size} (the TP ranks would not draw one dropout mask); "
                              f"set {lora.key}.dropout=0 or tensor_model_parallel_size=1")

    @property
    def tp(self) -> int:
        return self.tensor_model_parallel_size

    @property
    def pp(self) -> int:
        return self.pipeline_model_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def ep(self) -> int:
        return self.expert_model_parallel_size

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size


def _transformer_fields() -> list[str]:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return [f.name for f in dataclasses.fields(TransformerConfig) if f.init]


def _optimizer_fields() -> list[str]:
    from megatron.core.optimizer import OptimizerConfig

    return [f.name for f in dataclasses.fields(OptimizerConfig) if f.init]


def _ddp_fields() -> list[str]:
    from megatron.core.distributed import DistributedDataParallelConfig

    return [f.name for f in dataclasses.fields(DistributedDataParallelConfig) if f.init]


def _scheduler_fields() -> list[str]:
    import inspect

    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    return [n for n in inspect.signature(OptimizerParamScheduler.__init__).parameters if n not in ("self", "optimizer")]


def _check_fields(section: str, key: str, values: dict[str, Any], valid: list[str]) -> None:
    unknown = [name for name in values if name not in valid]
    if unknown:
        raise ConfigError(f"unknown config key{'s' * (len(unknown) > 1)} {describe_unknown_keys(f'{section}.{key}', unknown, valid)} "
                          f"(checked against megatron's {key} fields)")


def parse_megatron_config(raw: dict[str, Any], section: str = SECTION) -> MegatronConfig:
    """Validate the engine's section (`section`: where the user wrote it, `policy.megatron_cfg` or
    `policy.engine_cfg`): own keys typed and checked, the rest checked against TransformerConfig."""
    own = [f.name for f in dataclasses.fields(MegatronConfig) if f.name != "transformer_config"]
    transformer = _transformer_fields()
    unknown = [key for key in raw if key not in own and key not in transformer]
    if unknown:
        raise ConfigError(f"unknown config key{'s' * (len(unknown) > 1)} {describe_unknown_keys(section, unknown, own + transformer)}. "
                          f"Keys other than {sorted(own)} must be fields of megatron.core's TransformerConfig.")
    known = {key: value for key, value in raw.items() if key in own}
    extra = {key: value for key, value in raw.items() if key not in own}
    cfg = parse_config(MegatronConfig, known, section)
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "expert_model_parallel_size", "expert_tensor_parallel_size"):
        if getattr(cfg, key) is not None and getattr(cfg, key) < 1:
            raise ConfigError(f"{section}.{key} must be >= 1; got {getattr(cfg, key)}")
    _check_fields(section, "optimizer", cfg.optimizer, _optimizer_fields())
    _check_fields(section, "scheduler", cfg.scheduler, _scheduler_fields())
    _check_fields(section, "distributed_data_parallel_config", cfg.distributed_data_parallel_config, _ddp_fields())
    if cfg.distributed_data_parallel_config.get("overlap_param_gather"):
        # It defers the distributed optimizer's parameter all-gather to the next forward, but the refit reads
        # every weight right after the step (it sent half of them from before the step: CPU, DP2); and with
        # a refit per step there is nothing for the gather to overlap with.
        raise ConfigError(f"{section}.distributed_data_parallel_config.overlap_param_gather=true is not supported: "
                          "the weight refit after every step needs the parameters gathered at once; remove the key")
    _one_distributed_optimizer_setting(section, cfg)
    cfg.transformer_config = extra
    return cfg


def _one_distributed_optimizer_setting(section: str, cfg: MegatronConfig) -> None:
    """megatron reads `use_distributed_optimizer` in two places, the optimizer and DDP (the latter reduce-scatters the
    grads for it): set in one, the other follows; contradicting values are an error. Apart, a DDP that
    reduce-scattered fed a whole-buffer optimizer half-reduced grads (ranks stepped on different grad norms), and the
    other way round megatron failed at the first step."""
    keys = ("optimizer", "distributed_data_parallel_config")
    given = {key: getattr(cfg, key)["use_distributed_optimizer"] for key in keys
             if "use_distributed_optimizer" in getattr(cfg, key)}
    if len(set(given.values())) > 1:
        raise ConfigError(f"{section}.optimizer.use_distributed_optimizer={given['optimizer']} contradicts "
                          f"{section}.distributed_data_parallel_config.use_distributed_optimizer="
                          f"{given['distributed_data_parallel_config']}: they are one setting; set one of them")
    if given:
        value = next(iter(given.values()))
        for key in keys:
            setattr(cfg, key, {**getattr(cfg, key), "use_distributed_optimizer": value})


@dataclass(kw_only=True)
class ResolvedSettings:
    """The concrete choices the engine makes, logged once as the resolved config."""

    sequence_parallel: bool
    packing: bool
    pack_multiple: int  # every packed sequence padded to a multiple of this (2*CP*TP)
    seq_multiple: int  # a padded micro-batch's length is a multiple of this (TP with SP, 2*CP*TP with CP)
    transformer_overrides: dict[str, Any]  # extra TransformerConfig fields passed to ckpt-convert
    use_cuda: bool
    attention: Literal["transformer_engine", "local"] = "local"

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in dataclasses.asdict(self).items())


def sequence_parallel_on(cfg: MegatronConfig) -> bool:
    """`sequence_parallel` as the engine runs it: None means TP > 1, and it is off at TP=1 (it does nothing)."""
    sp = cfg.sequence_parallel if cfg.sequence_parallel is not None else cfg.tp > 1
    return sp and cfg.tp > 1


def length_multiples(cfg: MegatronConfig) -> tuple[int, int]:
    """(pack_multiple, seq_multiple) of `ResolvedSettings`, from the config alone: every packed sequence is
    padded to a multiple of 2*CP*TP (with TP or CP > 1), a padded micro-batch's length to TP under sequence
    parallel (2*CP*TP with CP)."""
    pack_multiple = 2 * cfg.cp * cfg.tp if cfg.cp * cfg.tp > 1 else 1
    seq_multiple = pack_multiple if cfg.cp > 1 else (cfg.tp if sequence_parallel_on(cfg) else 1)
    return pack_multiple, seq_multiple


def planning_multiple(policy: PolicyConfig, cfg: MegatronConfig) -> int:
    """The `seq_multiple` `batching.plan` prices sequences by: pack_multiple when packing, else seq_multiple."""
    pack_multiple, seq_multiple = length_multiples(cfg)
    return pack_multiple if policy.sequence_packing.enabled else seq_multiple


def resolve_settings(policy: PolicyConfig, cfg: MegatronConfig, hf_config: Any, world_size: int,
                     use_cuda: bool) -> ResolvedSettings:
    """Cross-field checks (fail before any model is built) and the automatic settings."""
    section = policy.engine_options_key
    model_parallel = cfg.tp * cfg.pp * cfg.cp
    if world_size % model_parallel:
        raise ConfigError(f"world size {world_size} is not divisible by TP*PP*CP = {cfg.tp}*{cfg.pp}*{cfg.cp}; "
                          f"change {section}.tensor/pipeline/context_model_parallel_size or the number of ranks")
    check_model_layout(policy, cfg, hf_config)
    packing = policy.sequence_packing.enabled
    attention = attention_backend(use_cuda, cfg.lora_cfg.enabled)
    if cfg.cp > 1 and attention != "transformer_engine":
        raise ConfigError(f"{section}.context_parallel_size={cfg.cp} needs CUDA and transformer-engine (megatron's "
                          "local attention has no context parallelism), and LoRA off (it takes the local layer "
                          "spec); install transformer-engine, or use context_parallel_size=1")
    if (world_size // model_parallel) * cfg.cp * cfg.tp % (cfg.ep * cfg.etp):
        raise ConfigError(f"{section}.expert_model_parallel_size={cfg.ep} x expert_tensor_parallel_size={cfg.etp} "
                          f"(unset: = TP) must divide DP*CP*TP = {world_size // model_parallel * cfg.cp * cfg.tp}")
    if cfg.sequence_parallel and cfg.tp == 1:
        logger.warning("%s.sequence_parallel=true with TP=1 does nothing; turning it off", section)
    sp = sequence_parallel_on(cfg)
    pack_multiple, seq_multiple = length_multiples(cfg)
    overrides = _automatic_overrides(cfg, use_cuda, section)
    return ResolvedSettings(sequence_parallel=sp, packing=packing, pack_multiple=pack_multiple,
                            seq_multiple=seq_multiple, transformer_overrides=overrides, use_cuda=use_cuda,
                            attention=attention)


def check_model_layout(policy: PolicyConfig, cfg: MegatronConfig, hf_config: Any) -> None:
    """The checks of the parallel layout against the model that need no world size or device: the trainer's
    preflight runs them (MegatronEngine.check_model) before any worker starts."""
    section = policy.engine_options_key
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if heads % cfg.tp or kv_heads % cfg.tp:
        raise ConfigError(f"{section}.tensor_model_parallel_size={cfg.tp} must divide the model's attention heads "
                          f"({heads}) and key/value heads ({kv_heads}); choose a TP size that divides {math.gcd(heads, kv_heads)}")
    num_layers = hf_config.num_hidden_layers
    if num_layers % cfg.pp:
        raise ConfigError(f"{section}.pipeline_model_parallel_size={cfg.pp} must divide num_hidden_layers={num_layers}")
    if cfg.cp > 1 and not policy.sequence_packing.enabled:
        raise ConfigError(f"{section}.context_parallel_size={cfg.cp} needs packed sequences: set "
                          "policy.sequence_packing.enabled=true (CP shards the load-balanced packed layout)")
    num_experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
    if cfg.ep > 1 and (not num_experts or num_experts % cfg.ep):
        raise ConfigError(f"{section}.expert_model_parallel_size={cfg.ep} must divide the number of experts "
                          f"({num_experts or 'none: a dense model'})")
    if num_experts and cfg.ep == 1 and cfg.etp != cfg.tp:
        raise ConfigError(f"{section}.expert_tensor_parallel_size={cfg.etp} with tensor_model_parallel_size={cfg.tp} "
                          "needs expert_model_parallel_size > 1: with EP=1 megatron reduces expert gradients like "
                          "dense ones, and the experts' copies on the TP ranks drift apart; leave "
                          "expert_tensor_parallel_size unset (= TP)")
    if num_experts and cfg.tp > 1 and not sequence_parallel_on(cfg):
        raise ConfigError(f"{section}.sequence_parallel=false with tensor_model_parallel_size={cfg.tp} on a model with "
                          "experts: megatron's MoE layer refuses to train under TP without sequence parallelism; "
                          f"remove {section}.sequence_parallel (it is on by default under TP)")


def _fusions(cfg: MegatronConfig, use_cuda: bool, section: str) -> dict[str, bool]:
    """Each fusion on when CUDA is present and its library imports; a user key wins unless it asks for a
    fusion that cannot run here."""
    available = available_fusions() if use_cuda else dict.fromkeys(FUSION_LIBRARIES, False)
    for name, library in FUSION_LIBRARIES.items():
        if cfg.transformer_config.get(name) and not available[name]:
            where = "this machine has no CUDA" if not use_cuda else f"{library} does not import"
            raise ConfigError(f"{section}.{name}=true needs {library}, and {where}; install it or set "
                              f"{section}.{name}=false (or leave it out: it is on whenever it can run)")
    return dict(available)


def _automatic_overrides(cfg: MegatronConfig, use_cuda: bool, section: str) -> dict[str, Any]:
    out: dict[str, Any] = _fusions(cfg, use_cuda, section)
    # gloo has no batched p2p that megatron's interleaved schedule can use correctly (the probe measured
    # silently wrong grads with batch_p2p_comm=True under gloo): use single send/recv without CUDA.
    out["batch_p2p_comm"] = use_cuda
    out["variable_seq_lengths"] = False  # every micro-batch of a step is padded to one shape (engine)
    out["hidden_dropout"] = 0.0  # RL recomputes logprobs: dropout would make them disagree with sampling
    out["attention_dropout"] = 0.0
    out.update(cfg.activation_checkpointing.transformer_kwargs())
    out.update(cfg.transformer_config)  # user keys win over automatic ones
    return out
