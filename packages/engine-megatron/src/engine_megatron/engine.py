"""`MegatronEngine`: rl-core's TrainingEngine on megatron-core (TP/PP/CP/EP/SP, distributed optimizer).

Owns the engine calls: micro-batches of a rank's DP shard run through megatron's
`get_forward_backward_func` (so pipeline parallelism uses megatron's schedules), target logprobs and
entropy computed vocab-parallel on the last stage and handed to the loss as flat per-token tensors with
global normalisers, the optimizer step and the weights-only reference policy (with LoRA: the base model, the
adapters off). The model config and weight names come from ckpt-convert; building the model (model.py), LoRA
(lora.py, lora_layers.py), batching, logprobs, the optimizer, checkpoints and process groups live in the modules
beside this one.

Loss scaling: a `LossFn` returns this micro-batch's share of the global-batch loss (global normalisers),
so the gradient we want is the SUM over micro-batches and DP ranks. Megatron's schedule divides each
micro-batch loss by the number of micro-batches (and multiplies by CP), and DDP averages grads over DP
(x CP): the loss handed to megatron is multiplied back by `num_micro_batches * DP / CP`.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from engine_megatron import batching, checkpoint, lora
from engine_megatron.compat import device_context, prepare_device
from engine_megatron.config import (
    MegatronConfig,
    check_model_layout,
    parse_megatron_config,
    planning_multiple,
    resolve_settings,
    sequence_parallel_on,
)
from engine_megatron.model import (
    adapter_export,
    build_ddp_model,
    convert_once,
    export_hf_tensors,
    gpt_model,
    hf_export,
    load_converted,
)
from engine_megatron.optim import build_optimizer, build_scheduler, megatron_optimizer_config, optimizer_step
from engine_megatron.parallel import broadcast_from_last_stage, init_model_parallel
from engine_megatron.router_losses import clear_router_losses, router_losses
from engine_megatron.vocab_parallel import vocab_parallel_logprobs
from rl_core import checkpoint_io
from rl_core.batch import LossFn, LossInputs, StepResult, TokenBatch
from rl_core.config import PolicyConfig
from rl_core.distributed import init_process_group
from rl_core.interfaces import TrainingEngine
from rl_core.lora import BaseModel, BaseModelReference, write_adapter_dir
from rl_core.metrics import all_reduce_metrics, combine_metrics
from rl_core.reference import FrozenWeights
from rl_core.registry import register_engine

logger = logging.getLogger(__name__)


@dataclass
class _StepState:
    """What the loss closure needs and collects during one schedule run."""

    loss_fn: LossFn | None  # None: only collect logprobs
    num_valid_tokens: float = 0.0
    num_valid_seqs: float = 0.0
    scale: float = 1.0
    # device tensors, read once after the schedule ran: a read per micro-batch would stall the host
    losses: list[Tensor] = field(default_factory=list)
    metrics: list[dict[str, Tensor]] = field(default_factory=list)
    logprobs: list[tuple[Tensor, batching.MicroBatch] | None] = field(default_factory=list)


@register_engine("megatron")
class MegatronEngine(TrainingEngine):
    """A policy model on megatron-core; see the module docstring."""

    @classmethod
    def validate_config(cls, policy: PolicyConfig) -> MegatronConfig:
        """Check `policy.megatron_cfg` (incl. TransformerConfig keys) without building anything (LoRA left in the
        DTensor engine's section is PolicyConfig's error)."""
        return parse_megatron_config(policy.engine_options, policy.engine_options_key)

    @classmethod
    def sequence_multiple(cls, policy: PolicyConfig) -> int:
        """The multiple `batching.plan` pads sequences to (packing: 2*CP*TP; padded: TP under sequence
        parallel), without building the engine."""
        return planning_multiple(policy, cls.validate_config(policy))

    @classmethod
    def check_model(cls, policy: PolicyConfig) -> None:
        """ValueError naming the architecture and the supported ones if ckpt-convert cannot map
        `policy.model_name`, or if LoRA's target / exclude modules match none of its modules or it has experts (the
        trainer's preflight calls it before any worker starts)."""
        from ckpt_convert.mcore_model import load_hf_config, mcore_model_config

        hf_config = load_hf_config(policy.model_name, source="policy.model_name")
        cfg = cls.validate_config(policy)
        check_model_layout(policy, cfg, hf_config)
        # the mapping itself (an MoE routing or layer mix megatron cannot express) and megatron's own config checks
        model_cfg = mcore_model_config(hf_config, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep, etp=cfg.etp, cp=cfg.cp,
                                       sequence_parallel=sequence_parallel_on(cfg))
        if cfg.lora_cfg.enabled:
            lora.select_targets(model_cfg, cfg.lora_cfg)

    @classmethod
    def checkpoint_to_hf(cls, checkpoint_dir: str, out_dir: str, *, model_dir: str) -> None:
        """An HF model directory from a `save_checkpoint` directory, offline (`ckpt-convert mcore2hf`): the
        checkpoint carries its own model config and HF side files; `model_dir` (the run's policy.model_name) is read
        for a LoRA checkpoint only, whose base weights it holds (the checkpoint has the adapters alone)."""
        from ckpt_convert.convert import convert_mcore_to_hf, new_output_dir

        new_output_dir(Path(out_dir))  # an existing out_dir is refused before the checkpoint is hashed
        checkpoint_io.verify_manifest(checkpoint_dir)  # ours always have one; mcore2hf would only warn
        convert_mcore_to_hf(checkpoint_dir, out_dir, base_model=model_dir)

    def __init__(self, policy: PolicyConfig) -> None:
        from ckpt_convert.mcore_model import load_hf_config, mcore_model_config

        self.policy = policy
        self.cfg = self.validate_config(policy)
        self.hf_config = load_hf_config(policy.model_name, source="policy.model_name")
        self.device = init_process_group(prepare_device().type == "cuda")
        world_size = dist.get_world_size()
        self.settings = resolve_settings(policy, self.cfg, self.hf_config, world_size, self.device.type == "cuda")
        self.ranks = init_model_parallel(self.cfg)
        self.model_cfg = mcore_model_config(
            self.hf_config, tp=self.cfg.tp, pp=self.cfg.pp, ep=self.cfg.ep, etp=self.cfg.etp,
            cp=self.cfg.cp, sequence_parallel=self.settings.sequence_parallel,
            params_dtype=getattr(torch, policy.precision), overrides=self.settings.transformer_overrides)
        if dist.get_rank() == 0:
            logger.info("megatron engine resolved config: %s; %s", self.cfg, self.settings.describe())
        self.lora_cfg = self.cfg.lora_cfg if self.cfg.lora_cfg.enabled else None
        # LoRA checkpoints hold the adapters alone: the base they apply to is this one, fingerprinted once
        self.lora_base = BaseModel.of(policy.model_name) if self.lora_cfg is not None else None
        self.model = build_ddp_model(self.model_cfg, self.cfg.distributed_data_parallel_config, self.ranks,
                                     self.lora_cfg)
        ckpt_dir = convert_once(policy.model_name, self.cfg.converted_checkpoint_dir, self.cfg.tp, self.cfg.pp,
                                self.cfg.ep, policy.precision)
        load_converted(self.model, ckpt_dir)
        with device_context():
            self.optimizer = build_optimizer(megatron_optimizer_config(policy, self.cfg), [self.model])
        self.scheduler = build_scheduler(self.optimizer, policy, self.cfg)
        self.vocab_size = int(self.hf_config.vocab_size)
        self._state: _StepState | None = None
        self._offloaded: list[tuple[Any, Tensor]] = []
        self.reference: FrozenWeights | BaseModelReference | None = None

    # ---- the TrainingEngine interface --------------------------------------------------------------

    @property
    def dp_rank(self) -> int:
        return self.ranks.dp_rank

    @property
    def dp_size(self) -> int:
        return self.ranks.dp_size

    def forward_backward(self, batch: TokenBatch, loss_fn: LossFn, *, forward_only: bool = False) -> StepResult:
        """Run every micro-batch of this rank's DP shard through `loss_fn`; grads accumulate unless forward_only."""
        from megatron.core import parallel_state as ps

        dp_group = ps.get_data_parallel_group()
        counts = torch.tensor([batch.num_valid_tokens(), batch.num_valid_seqs()], dtype=torch.float64)
        if self.ranks.dp_size > 1:
            dist.all_reduce(counts, group=dp_group)
        mb_plan = batching.plan(batch, self.policy, self.settings, training=True, dp_group=dp_group,
                                device=self.device)
        mbs = self._micro_batches(batch, mb_plan)
        state = _StepState(loss_fn=loss_fn, num_valid_tokens=float(counts[0]), num_valid_seqs=float(counts[1]),
                           scale=len(mbs) * self.ranks.dp_size / self.ranks.cp_size)
        routes_losses = self.model_cfg.is_moe and not forward_only
        if routes_losses:
            clear_router_losses()
        self._run(mbs, state, forward_only=forward_only)
        loss_sum = float(torch.stack(state.losses).sum()) if state.losses else 0.0
        summary = broadcast_from_last_stage((loss_sum, combine_metrics(state.metrics)), self.ranks)
        loss, metrics = summary
        reduced = all_reduce_metrics({"loss": loss, **metrics}, group=dp_group)
        if routes_losses:  # already averaged over DP by megatron's sync
            reduced.update(router_losses(self.model_cfg.transformer_config, len(mbs)))
        return StepResult(loss=reduced.pop("loss"), metrics=reduced, num_micro_batches=len(mbs))

    def compute_logprobs(self, batch: TokenBatch) -> list[Tensor]:
        """Per-sequence target-token logprobs (L_i,) float32 on CPU, in batch order."""
        from megatron.core import parallel_state as ps

        mb_plan = batching.plan(batch, self.policy, self.settings, training=False,
                                dp_group=ps.get_data_parallel_group(), device=self.device)
        mbs = self._micro_batches(batch, mb_plan)
        state = _StepState(loss_fn=None)
        self._run(mbs, state, forward_only=True)
        # one device-to-host copy per micro-batch, after all of them were queued
        per_mb = [[] if item is None else batching.per_sequence(item[0].float().cpu(), item[1])
                  for item in state.logprobs]
        per_mb = broadcast_from_last_stage(per_mb, self.ranks)
        return mb_plan.restore(per_mb)

    def snapshot_reference(self) -> None:
        """The current weights (this rank's TP/PP/EP shards) become the KL reference: a weights-only copy. With
        LoRA the reference is the base model, the policy with its adapters off (no copy)."""
        if self.lora_cfg is not None:
            from engine_megatron.lora_layers import lora_layers

            self.reference = BaseModelReference(lora_layers(gpt_model(self.model)))
        else:
            self.reference = FrozenWeights(self.model.parameters())

    def compute_ref_logprobs(self, batch: TokenBatch) -> list[Tensor]:
        """compute_logprobs with the reference weights copied into the DDP parameter buffers for the pass."""
        if self.reference is None:
            raise RuntimeError("compute_ref_logprobs before snapshot_reference(): take the reference first")
        with self.reference.swapped_in():
            return self.compute_logprobs(batch)

    def optimizer_step(self) -> dict[str, float]:
        """Clip (policy.max_grad_norm), step, advance the lr schedule; skip when the grad norm is not finite.
        The gradients are consumed either way (zeroed)."""
        with device_context():
            metrics = optimizer_step(self.optimizer, self.scheduler, self.policy.max_grad_norm)
        self.zero_grad()
        return metrics

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def export_hf_weights(self) -> Iterator[tuple[str, Tensor]]:
        """Full tensors under HF names, one at a time (TP/EP gathered, broadcast from the owning stage)."""
        yield from export_hf_tensors(self.model, self.model_cfg, self.hf_config, self.ranks, self._lora_scaling())

    def save_hf(self, path: str) -> None:
        """A Hugging Face model directory at `path` (replaced atomically): rank 0 streams the gathered
        tensors into safetensors shards, adds config.json and the tokenizer files of policy.model_name. With LoRA
        the merged weights, and the adapters alone in PEFT format in `path/adapter` (rl_core.lora.ADAPTER_DIR)."""
        from ckpt_convert.hf_io import write_hf_checkpoint

        plan, tensors = hf_export(self.model, self.model_cfg, self.hf_config, self.ranks, self._lora_scaling())
        adapters = adapter_export(self.model, self.model_cfg, self.ranks) if self.lora_cfg is not None else iter(())
        if dist.get_rank() == 0:
            with checkpoint_io.atomic_dir(path) as tmp:
                write_hf_checkpoint(tmp, plan, tensors, copy.deepcopy(self.hf_config), Path(self.policy.model_name))
                if self.lora_cfg is not None:
                    config = lora.peft_config(self.model_cfg, self.lora_cfg, self.policy.model_name)
                    write_adapter_dir(tmp, adapters, config)
        else:
            for _ in itertools.chain(tensors, adapters):  # the gathers and broadcasts are collective
                pass
        dist.barrier()
        logger.info("saved HF checkpoint %s", path)

    def save_checkpoint(self, path: str) -> None:
        """The engine checkpoint (with LoRA: the adapters and their optimizer state, no frozen base weight), plus
        what `ckpt-convert mcore2hf` needs beside it (model config, HF files; with LoRA the base model's record)."""
        from ckpt_convert.convert import save_conversion_metadata

        def write_conversion_metadata(directory: Path) -> None:  # inside the checkpoint's manifest
            adapters = (None if self.lora_cfg is None
                        else lora.conversion_metadata(self.model_cfg, self.lora_cfg, self.policy.model_name,
                                                      self.lora_base))
            save_conversion_metadata(directory, self.hf_config, self.model_cfg, self.policy.model_name,
                                     tp=self.cfg.tp, pp=self.cfg.pp, ep=self.cfg.ep, lora=adapters)

        checkpoint.save(path, self.model, self.optimizer, self.scheduler, write_conversion_metadata,
                        adapters_only=self.lora_cfg is not None)

    def load_checkpoint(self, path: str) -> None:
        """Restore `save_checkpoint`'s state; with LoRA onto the base model this engine loaded, which must be the
        one the adapters were trained on (ValueError naming policy.model_name otherwise)."""
        checkpoint.load(path, self.model, self.optimizer, self.scheduler, self._check_saved_files,
                        adapters_only=self.lora_base is not None)

    def _check_saved_files(self, directory: Path) -> None:
        self._check_expert_layout(directory)
        if self.lora_base is not None:
            self._check_lora_base(directory)

    def _check_expert_layout(self, directory: Path) -> None:
        """ValueError if `directory` was saved with EP = 1 and this engine runs EP > 1, or the reverse: megatron
        gives the experts an optimizer of their own only under EP > 1 (a chained optimizer, its state under other
        keys), and dist_checkpointing does not map one layout's keys onto the other's."""
        from ckpt_convert.convert import saved_layout

        saved_ep = saved_layout(directory)["ep"]
        if self.model_cfg.is_moe and (saved_ep > 1) != (self.cfg.ep > 1):
            key = f"{self.policy.engine_options_key}.expert_model_parallel_size"
            raise ValueError(f"{directory} was saved with expert_model_parallel_size={saved_ep} and this engine runs "
                             f"{key}={self.cfg.ep}: megatron keeps the experts' optimizer state apart only under EP > 1, "
                             "and its checkpoints do not reshard between EP = 1 and EP > 1; resume with "
                             f"{key}{' > 1' if saved_ep > 1 else '=1'} (TP, PP, DP and another EP > 1 may change)")

    def _check_lora_base(self, directory: Path) -> None:
        """ValueError unless checkpoint `directory` holds adapters trained on this engine's base model."""
        from ckpt_convert.convert import CONFIG_NAME, saved_lora

        saved = saved_lora(directory)
        if saved is None:
            raise ValueError(f"{directory} is a checkpoint of a full fine-tune (its {CONFIG_NAME} lists no adapters), "
                             "not of a LoRA run: resume it with policy.megatron_cfg.lora_cfg.enabled=false")
        BaseModel.from_dict(saved["base_model"]).check(self.lora_base, directory, "policy.model_name")

    def offload(self, *, keep_weights: bool = False) -> None:
        """Move weights, grads and optimizer state to host memory (a no-op on a CPU device)."""
        if self.device.type == "cpu":
            return
        self._storages_to_host(keep_weights)
        torch.cuda.empty_cache()

    def onload(self) -> None:
        for storage, host in self._offloaded:
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage())
        self._offloaded = []

    # ---- internals ----------------------------------------------------------------------------------

    def _storages_to_host(self, keep_weights: bool) -> None:
        """Storage by storage, so views (params into the DDP buffers; with fp32 params, the optimizer's
        shards into them too) stay valid and come back with onload. `keep_weights` keeps the storages of
        the weights (`_weights`), and with them every view into them."""
        skip = {t.untyped_storage().data_ptr() for t in self._weights()} if keep_weights else set()
        for tensor in self._device_tensors():
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in skip:  # already on the host, kept, or seen
                continue
            skip.add(storage.data_ptr())
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            host.untyped_storage().copy_(storage)
            self._offloaded.append((storage, host))
            storage.resize_(0)

    def _lora_scaling(self) -> float:
        """The adapters' factor in exported merged weights (unused without LoRA)."""
        return self.lora_cfg.scaling if self.lora_cfg is not None else 0.0

    def _ddp_buffers(self) -> list[Any]:
        return [*self.model.buffers, *self.model.expert_parallel_buffers]

    def _weights(self) -> Iterator[Tensor]:
        """Where the weights live: the DDP param buffers (every trained parameter is a view into one) and the
        parameters in none (a LoRA run's frozen base)."""
        for buffer in self._ddp_buffers():
            yield buffer.param_data
        yield from (p for p in self.model.parameters() if not p.requires_grad)

    def _device_tensors(self) -> Iterator[Tensor]:
        if isinstance(self.reference, FrozenWeights):  # a LoRA run's reference is the base weights themselves
            yield from self.reference.saved
        yield from self._weights()
        for buffer in self._ddp_buffers():
            yield buffer.grad_data
        for sub in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            for group in sub.optimizer.param_groups:
                yield from group["params"]
            for state in sub.optimizer.state.values():
                yield from (v for v in state.values() if torch.is_tensor(v) and v.device.type == self.device.type)

    def _micro_batches(self, batch: TokenBatch, mb_plan: Any) -> list[batching.MicroBatch]:
        mbs = batching.build_micro_batches(batch, mb_plan, self.settings, uniform_shape=self.ranks.pp_size > 1,
                                           cp_rank=self.ranks.cp_rank, cp_size=self.ranks.cp_size)
        batching.to_device(mbs, self.device)
        return mbs

    def _run(self, mbs: list[batching.MicroBatch], state: _StepState, *, forward_only: bool) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        rows, cols = mbs[0].shape
        self._state = state
        grad_mode = torch.no_grad() if forward_only else torch.enable_grad()
        try:
            with grad_mode, device_context():
                get_forward_backward_func()(
                    forward_step_func=self._forward_step, data_iterator=iter(mbs), model=[self.model],
                    num_microbatches=len(mbs), seq_length=cols * self.ranks.cp_size, micro_batch_size=rows,
                    forward_only=forward_only)
        finally:
            self._state = None

    def _forward_step(self, data_iterator: Iterator[batching.MicroBatch], model: Any) -> tuple[Tensor, Any]:
        mb = next(data_iterator)
        # bf16/fp16: keep the logits in that dtype (Float16Module would upcast all tokens x vocab to fp32);
        # the logprob chunks upcast chunk_tokens rows at a time.
        tc = self.model_cfg.transformer_config
        half = {"fp32_output": False} if tc.bf16 or tc.fp16 else {}
        # attention_mask None: padded rows use megatron's causal mask type, packed rows their packed_seq_params
        output = model(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params, **half)
        return output, functools.partial(self._loss_of, mb)

    def _loss_of(self, mb: batching.MicroBatch, logits: Tensor) -> tuple[Tensor, dict]:
        """Last stage: logits (B, S, V/TP) of one micro-batch -> (loss for megatron's backward, {})."""
        from megatron.core import parallel_state as ps

        state = self._state
        temperature = self.policy.temperature
        chunk = self.policy.logprob_chunk_tokens
        training = state.loss_fn is not None and bool(mb.weight)
        logprobs, entropy = vocab_parallel_logprobs(logits, mb.targets, self.vocab_size, temperature, chunk,
                                                    with_entropy=training, top_k=self.policy.top_k,
                                                    top_p=self.policy.top_p)  # (B, S) each
        cp_group = ps.get_context_parallel_group() if self.ranks.cp_size > 1 else None
        if cp_group is not None:
            logprobs = batching.gather_cp(logprobs, mb, cp_group)
        if not training:
            if state.loss_fn is None:
                state.logprobs.append((logprobs.detach(), mb) if mb.weight else None)
            if not torch.is_grad_enabled():  # forward only: no backward to run, so no need to read the logits
                return torch.zeros((), dtype=torch.float32, device=logits.device), {}
            # a zero that still runs the backward (and its TP/PP collectives) like every other micro-batch
            return logits.sum().float() * 0.0, {}
        if cp_group is not None:
            entropy = batching.gather_cp(entropy, mb, cp_group).detach()
        inputs = LossInputs.from_sequences(
            mb.batch, batching.per_sequence(logprobs, mb), num_valid_tokens=state.num_valid_tokens,
            num_valid_seqs=state.num_valid_seqs, entropy=batching.per_sequence(entropy, mb))
        loss, metrics = state.loss_fn(inputs)
        state.losses.append(loss.detach())
        state.metrics.append({k: v.detach() if torch.is_tensor(v) else v for k, v in metrics.items()})
        return loss * state.scale, {}
