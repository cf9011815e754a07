"""`policy.dtensor_cfg`: the settings only the DTensor/FSDP2 engine reads.

Owns the typed schema of the engine's own config section and its cross-field checks. The shared
`policy.*` keys (optimizer, scheduler, batching, packing) live in `rl_core.config.PolicyConfig`.
Validate with `DTensorConfig.from_policy(policy)`: unknown keys are errors naming the closest key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import ClassVar, Literal

from rl_core import lora as shared_lora
from rl_core.config import ConfigError, PolicyConfig, parse_config

Precision = Literal["float32", "bfloat16"]
AttnImplementation = Literal["auto", "sdpa_segments", "sdpa", "eager", "flash_attention_2"]


@dataclass(kw_only=True)
class LoRAConfig(shared_lora.LoRAConfig):
    """`policy.dtensor_cfg.lora_cfg`: low-rank adapters (lora.py) trained on frozen base weights (the schema and its
    meaning are rl_core.lora's, shared with the Megatron engine)."""

    key: ClassVar[str] = "policy.dtensor_cfg.lora_cfg"


@dataclass(kw_only=True)
class DTensorConfig:
    """`policy.dtensor_cfg.*` (the `enabled` switch is read by rl-core, not here)."""

    tensor_parallel_size: int = 1
    sequence_parallel: bool = False  # shard norms/residuals over the sequence inside the TP group
    activation_checkpointing: bool = False  # recompute every decoder layer in backward
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: sharded params, grads and optimizer state on host
    precision: Precision | None = None  # None: use policy.precision
    compile: bool = False  # torch.compile each decoder layer
    # "auto": sdpa_segments (packed rows: one varlen kernel call per layer on CUDA, flash-attn's when installed,
    # else torch's; one sdpa per sequence on the CPU). "sdpa": a block-diagonal mask over the packed row.
    # "flash_attention_2": HF's own path (a host read of a GPU tensor per layer to find the boundaries).
    attn_implementation: AttnImplementation = "auto"
    lora_cfg: LoRAConfig = field(default_factory=LoRAConfig)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ConfigError(
                f"policy.dtensor_cfg.tensor_parallel_size must be >= 1; got {self.tensor_parallel_size}"
            )
        if self.sequence_parallel and self.tensor_parallel_size == 1:
            raise ConfigError(
                "policy.dtensor_cfg.sequence_parallel=true needs tensor_parallel_size > 1; "
                "set tensor_parallel_size or turn sequence_parallel off"
            )
        if self.lora_cfg.enabled and self.lora_cfg.dropout > 0 and self.tensor_parallel_size > 1:
            # a replicated adapter input needs one mask on every TP rank, a sharded one the shards of one mask:
            # DTensor draws them so only on CUDA (its RNG tracker), untested here, and elsewhere each rank draws
            # its own
            raise ConfigError(
                f"policy.dtensor_cfg.lora_cfg.dropout={self.lora_cfg.dropout} is not supported with "
                f"tensor_parallel_size={self.tensor_parallel_size} (the TP ranks would not draw one dropout mask); "
                "set policy.dtensor_cfg.lora_cfg.dropout=0 or tensor_parallel_size=1"
            )

    @property
    def seq_multiple(self) -> int:
        """The multiple every sequence (padded: the row width; packed: the packed row) is padded to: the TP
        size under sequence parallel, which splits the sequence dimension over the TP ranks."""
        return self.tensor_parallel_size if self.sequence_parallel else 1

    @classmethod
    def from_policy(cls, policy: PolicyConfig) -> DTensorConfig:
        """Validate `policy.dtensor_cfg` and resolve `precision` against `policy.precision`."""
        cfg = parse_config(cls, policy.engine_options, policy.engine_options_key)
        precision = cfg.precision or policy.precision
        if precision not in ("float32", "bfloat16"):
            raise ConfigError(
                f"policy.precision={precision!r} is not supported by the DTensor engine (fp16 would need "
                "loss scaling); use 'bfloat16' or 'float32'"
            )
        return replace(cfg, precision=precision)
