"""`DTensorEngine`: rl-core's TrainingEngine for Hugging Face causal LMs on FSDP2 + DTensor TP.

Owns the engine's life cycle: process group and mesh, model initialisation (meta device, sharded,
weights streamed into the shards: loading.py), micro-batch planning with
seqpack (every DP rank runs the same number of micro-batches, which FSDP's collectives need), the
global loss normalisers, the optimizer step, checkpoints, export and offload. How the model is
sharded lives in parallelize.py, the forward pass and logprob alignment in forward.py (the vocab-parallel
logprob kernel is rl_core.logprobs', shared with engine-megatron), DCP and HF export in checkpoint.py.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Iterator
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule

import seqpack
from engine_dtensor import checkpoint, lora
from engine_dtensor.attention import SEGMENT_SDPA
from engine_dtensor.config import DTensorConfig, LoRAConfig
from engine_dtensor.forward import ModelInputs, build_packed_inputs, build_padded_inputs, forward_logprobs
from engine_dtensor.loading import attention_softcap, build_meta_model, materialize
from engine_dtensor.optim import build_optimizer, build_scheduler, clip_grads_
from engine_dtensor.parallel_dims import ParallelDims
from engine_dtensor.parallelize import check_tp_supported, decoder_layers, parallelize
from rl_core.batch import LossFn, LossInputs, StepResult, TokenBatch
from rl_core.config import PolicyConfig, micro_batch_limits
from rl_core.distributed import init_process_group
from rl_core.interfaces import TrainingEngine
from rl_core.lora import BaseModel, BaseModelReference
from rl_core.metrics import all_reduce_metrics, combine_metrics
from rl_core.reference import FrozenWeights
from rl_core.registry import register_engine

logger = logging.getLogger(__name__)


def resolve_attn_implementation(requested: str, device: torch.device, precision: str, *,
                                softcap: float | None = None) -> str:
    """`auto` is sdpa_segments: packed rows through one varlen kernel call per layer (flash-attn's when
    installed, else torch's; per-sequence sdpa on the CPU), padded rows through HF's sdpa. HF's
    flash_attention_2 only when asked for: it finds packed boundaries, and unpads padded rows, with a host
    read of a GPU tensor in every layer. A model that soft-caps its attention logits (`softcap`, Gemma 2)
    gets eager, the one implementation that applies the cap (as transformers itself chooses for it)."""
    if softcap is not None:
        if requested not in ("auto", "eager"):
            raise ValueError(
                f"policy.dtensor_cfg.attn_implementation={requested!r} ignores the model's attention logit soft-cap "
                f"(attn_logit_softcapping={softcap}): it would train another model than the checkpoint's; set it "
                "to 'eager' or 'auto'")
        logger.info("attention: eager (the model soft-caps its attention logits at %s)", softcap)
        return "eager"
    has_flash = importlib.util.find_spec("flash_attn") is not None
    if requested == "flash_attention_2":
        if not (has_flash and device.type == "cuda"):
            raise ValueError(
                "policy.dtensor_cfg.attn_implementation='flash_attention_2' needs CUDA and flash-attn "
                "(pip install 'engine-dtensor[gpu]'); or set it to 'auto' or 'sdpa'"
            )
        if precision != "bfloat16":
            raise ValueError(
                "policy.dtensor_cfg.attn_implementation='flash_attention_2' needs policy.precision='bfloat16' "
                f"(flash-attn has no float32 kernels); got {precision!r}"
            )
    if requested != "auto":
        return requested
    logger.info("attention: %s (packed sequences: a varlen kernel on CUDA in bf16, else one causal sdpa each)",
                SEGMENT_SDPA)
    return SEGMENT_SDPA


@register_engine("dtensor")
class DTensorEngine(TrainingEngine):
    """FSDP2 (+ DTensor TP) training engine; `batch` arguments are this DP rank's shard (`train_batch`:
    rl-core's template)."""

    @classmethod
    def validate_config(cls, policy: PolicyConfig) -> DTensorConfig:
        """Check `policy.dtensor_cfg` without building anything (the trainer calls this before workers start)."""
        return DTensorConfig.from_policy(policy)

    @classmethod
    def sequence_multiple(cls, policy: PolicyConfig) -> int:
        """The multiple this engine pads sequences to (TP under sequence parallel), without building it."""
        return cls.validate_config(policy).seq_multiple

    @classmethod
    def check_model(cls, policy: PolicyConfig) -> None:
        """ValueError if `policy.model_name` has no decoder layers to wrap, no TP plan for the configured
        tensor_parallel_size, or LoRA's target / exclude modules match none of its linear layers; built on the meta
        device (config.json only), so the trainer's preflight finds it before Ray instead of the policy actors after
        the model load."""
        cfg = cls.validate_config(policy)
        lora_cfg = cfg.lora_cfg
        model = build_meta_model(policy.model_name, "eager")
        try:
            decoder_layers(model)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
        if cfg.tensor_parallel_size > 1:
            check_tp_supported(model, cfg.tensor_parallel_size)
        if lora_cfg.enabled:
            lora.select_targets(model, lora_cfg)

    @classmethod
    def checkpoint_to_hf(cls, checkpoint_dir: str, out_dir: str, *, model_dir: str) -> None:
        """An HF model directory from a `save_checkpoint` directory, offline (one CPU process, weights only),
        so that exporting needs no restart of the engine on the training layout; for a LoRA checkpoint (the adapters
        alone, the base weights read from `model_dir`, which must be the base they were trained on) what save_hf
        writes: the merged weights and the adapter in PEFT format."""
        checkpoint.checkpoint_to_hf(checkpoint_dir, out_dir, model_dir=model_dir)

    def __init__(self, policy: PolicyConfig) -> None:
        self.policy = policy
        self.cfg = self.validate_config(policy)
        self.device = init_process_group(torch.cuda.is_available())
        self.parallel_dims = ParallelDims.from_world(dist.get_world_size(), self.cfg.tensor_parallel_size)
        self.parallel_dims.build_mesh(self.device.type)
        dp_mesh = self.parallel_dims.get_mesh("dp")
        self.dp_group = dp_mesh.get_group()
        self.dp_rank, self.dp_size = dp_mesh.get_local_rank(), self.parallel_dims.dp
        # sequence parallel splits the sequence dim over TP ranks: lengths must divide evenly
        self.seq_multiple = self.cfg.seq_multiple
        self.attn_impl = resolve_attn_implementation(
            self.cfg.attn_implementation, self.device, self.cfg.precision,
            softcap=attention_softcap(policy.model_name),
        )
        # torchtitan's order: shapes on the meta device, shard, then storage and weights for the shards only
        # (fp32 master weights; the compute dtype is FSDP's job), so no rank ever holds the whole model.
        self.model = build_meta_model(policy.model_name, self.attn_impl)
        self.lora_checkpoint: checkpoint.LoRACheckpoint | None = None  # with LoRA: what its checkpoints record
        if self.cfg.lora_cfg.enabled:  # before any wrapper: FSDP2 shards adapters and frozen base weights together
            frozen_dtype = getattr(torch, self.cfg.precision)
            lora.apply_lora(self.model, self.cfg.lora_cfg, frozen_dtype=frozen_dtype)
            # the checkpoints hold the adapters alone: the base they apply to is this one, fingerprinted once
            self.lora_checkpoint = checkpoint.LoRACheckpoint(self.cfg.lora_cfg, BaseModel.of(policy.model_name),
                                                             frozen_dtype)
        parallelize(self.model, self.parallel_dims, self.cfg)
        device = torch.device("cpu") if self.cfg.cpu_offload else self.device
        with lora.adapters_detached(self.model):  # the HF checkpoint has base weights only
            materialize(self.model, policy.model_name, device)
        lora.materialize_adapters(self.model, device)
        self.trainable_params = [p for p in self.model.parameters() if p.requires_grad]  # LoRA: the adapters
        self.optimizer = build_optimizer(self.trainable_params, policy.optimizer)
        self.scheduler = build_scheduler(self.optimizer, policy.scheduler)
        self.reference: FrozenWeights | BaseModelReference | None = None

    # ---- micro-batching -------------------------------------------------------------------------

    def _all_reduce(self, values: list[float]) -> list[float]:
        """Sums over the DP ranks."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.dp_group)
        return t.tolist()

    def _plan(self, lengths: list[int], *, train: bool) -> seqpack.MicroBatchPlan:
        """Micro-batches by count or token budget, as many on every DP rank (FSDP's collectives need it)."""
        limits = micro_batch_limits(self.policy, training=train, seq_multiple=self.seq_multiple)
        return seqpack.plan_dp_micro_batches(lengths, group=self.dp_group, device=self.device, **limits)

    def _forward(self, seqs: list[Tensor], *, with_entropy: bool) -> tuple[ModelInputs, Tensor, Tensor | None]:
        """The micro-batch's model inputs and its (B, S) logprobs (and entropies) on the device."""
        build = build_packed_inputs if self.policy.sequence_packing.enabled else build_padded_inputs
        inputs = build(seqs, attn_impl=self.attn_impl, seq_multiple=self.seq_multiple, device=self.device)
        logprobs, entropy = forward_logprobs(
            self.model, inputs, temperature=self.policy.temperature, with_entropy=with_entropy,
            chunk_tokens=self.policy.logprob_chunk_tokens, top_k=self.policy.top_k, top_p=self.policy.top_p,
        )
        return inputs, logprobs, entropy

    def _sequence_logprobs(
        self, seqs: list[Tensor], *, with_entropy: bool
    ) -> tuple[list[Tensor], list[Tensor] | None]:
        inputs, logprobs, entropy = self._forward(seqs, with_entropy=with_entropy)
        return inputs.unpack(logprobs), None if entropy is None else inputs.unpack(entropy)

    def _dummy_micro_batch(self, batch: TokenBatch, *, backward: bool) -> None:
        """A zero-weight forward (and backward) so this rank joins the FSDP collectives of the others."""
        logprobs, _ = self._sequence_logprobs(batch.dummy(self.seq_multiple).input_ids, with_entropy=False)
        if backward:
            (logprobs[0].sum() * 0.0).backward()

    # ---- TrainingEngine -------------------------------------------------------------------------

    def forward_backward(
        self, batch: TokenBatch, loss_fn: LossFn, *, forward_only: bool = False
    ) -> StepResult:
        """Sum of micro-batch losses with global-batch normalisers; grads accumulate unless forward_only."""
        num_tokens, num_seqs = self._all_reduce([batch.num_valid_tokens(), batch.num_valid_seqs()])
        plan = self._plan(batch.lengths, train=True)
        self.model.train(not forward_only)
        # device tensors, read once after the loop: a read per micro-batch would stall the host
        local_loss, parts = torch.zeros((), device=self.device), []
        with torch.no_grad() if forward_only else nullcontext():
            for indices in plan.micro_batches:
                if not indices:
                    self._dummy_micro_batch(batch, backward=not forward_only)
                    continue
                micro = batch.select(indices)
                logprobs, entropy = self._sequence_logprobs(micro.input_ids, with_entropy=True)
                inputs = LossInputs.from_sequences(
                    micro, logprobs, num_valid_tokens=num_tokens, num_valid_seqs=num_seqs, entropy=entropy
                )
                loss, metrics = loss_fn(inputs)
                if not forward_only:
                    loss.backward()
                local_loss += loss.detach()
                parts.append(metrics)
        metrics = all_reduce_metrics(combine_metrics(parts), group=self.dp_group)
        (loss_sum,) = self._all_reduce([float(local_loss)])
        return StepResult(loss=loss_sum, metrics=metrics, num_micro_batches=len(plan.micro_batches))

    @torch.no_grad()
    def compute_logprobs(self, batch: TokenBatch) -> list[Tensor]:
        """Per-sequence (L_i,) float32 CPU logprobs in the batch's order (policy.temperature applied)."""
        plan = self._plan(batch.lengths, train=False)
        self.model.eval()
        pending: list[tuple[ModelInputs, Tensor] | None] = []
        for indices in plan.micro_batches:
            if not indices:
                self._dummy_micro_batch(batch, backward=False)
                pending.append(None)
                continue
            inputs, logprobs, _ = self._forward([batch.input_ids[i] for i in indices], with_entropy=False)
            pending.append((inputs, logprobs))
        # one device-to-host copy per micro-batch, after all of them were queued; compact tensors, not
        # views of the (B, S) rows (a view pickles its whole storage)
        outputs = [[] if item is None else [lp.clone() for lp in item[0].unpack(item[1].float().cpu())]
                   for item in pending]
        return plan.restore(outputs)

    def snapshot_reference(self) -> None:
        """The current weights (this rank's shards) become the KL reference: a weights-only copy. With LoRA the
        reference is the base model (adapters off; the policy at initialisation, B = 0), whenever this is called
        and after a resume too: no copy of the weights."""
        if self.cfg.lora_cfg.enabled:
            self.reference = BaseModelReference(lora.lora_modules(self.model))
        else:
            # after a forward FSDP2 leaves the root's parameters unsharded: the copy is of the shards (the
            # unsharded tensors' storage is freed at the next reshard, and the swap read freed memory: a segfault)
            self._reshard()
            self.reference = FrozenWeights(self.model.parameters())

    def compute_ref_logprobs(self, batch: TokenBatch) -> list[Tensor]:
        """compute_logprobs with the reference weights swapped into the model for the pass."""
        if self.reference is None:
            raise RuntimeError("compute_ref_logprobs before snapshot_reference(): take the reference first")
        # FSDP2 keeps the root module's parameters unsharded between passes: drop them on both sides of
        # the swap so that each pass all-gathers the values the shards hold now.
        self._reshard()
        with self.reference.swapped_in():
            logprobs = self.compute_logprobs(batch)
            self._reshard()
        return logprobs

    def _reshard(self) -> None:
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def optimizer_step(self) -> dict[str, float]:
        """Clip by the global grad norm, step (or skip if not finite), advance the LR schedule."""
        grad_norm = clip_grads_(self.trainable_params, self.policy.max_grad_norm)
        lr = float(self.optimizer.param_groups[0]["lr"])
        skipped = not math.isfinite(grad_norm)
        if skipped:  # the schedule does not advance either: the step did not happen
            logger.warning("grad norm is %s: optimizer step skipped", grad_norm)
        else:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm": grad_norm, "lr": lr, "skipped": float(skipped)}

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def export_hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        return checkpoint.export_hf_weights(self.model)

    def save_hf(self, path: str) -> None:
        """A Hugging Face checkpoint (safetensors + config + tokenizer files) at `path`; with LoRA the merged
        weights, and the adapters alone in PEFT format in `path/adapter` (checkpoint.ADAPTER_DIR)."""
        checkpoint.save_hf(path, self.model, self.policy.model_name, self._lora_cfg())

    def save_checkpoint(self, path: str) -> None:
        """DCP checkpoint at `path`; with LoRA the adapters (and their optimizer state), no frozen base weight."""
        checkpoint.save_checkpoint(path, self.model, self.optimizer, self.scheduler, self.lora_checkpoint)

    def _lora_cfg(self) -> LoRAConfig | None:
        return self.cfg.lora_cfg if self.cfg.lora_cfg.enabled else None

    def load_checkpoint(self, path: str) -> None:
        """Restore `save_checkpoint`'s state; with LoRA onto the base model this engine loaded, which must be the
        one the adapters were trained on (ValueError naming policy.model_name otherwise)."""
        base = self.lora_checkpoint.base if self.lora_checkpoint is not None else None
        checkpoint.load_checkpoint(path, self.model, self.optimizer, self.scheduler, base)

    def offload(self, *, keep_weights: bool = False) -> None:
        self._move_to(torch.device("cpu"), keep_weights=keep_weights)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def onload(self) -> None:
        self._move_to(self.device)

    def _move_to(self, device: torch.device, *, keep_weights: bool = False) -> None:
        """Parameters (FSDP2 re-registers its shards; unless `keep_weights`), the reference copy and optimizer
        state to `device`. Gradients need no move: optimizer_step and zero_grad set them to None."""
        if self.cfg.cpu_offload:
            return  # FSDP's CPUOffloadPolicy already keeps them on the host
        if not keep_weights:
            self.model.to(device)
        if self.reference is not None:
            self.reference.to(device)
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, Tensor) and key != "step":
                    state[key] = value.to(device, non_blocking=True)
        if torch.cuda.is_available():  # both ways: a non-blocking copy to the host may still be running
            torch.cuda.synchronize()
