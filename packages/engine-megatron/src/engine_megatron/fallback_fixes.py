"""Fixes for megatron-core's own fallbacks when transformer-engine and apex are missing, on any device.

Without TE and apex, megatron builds its local layer spec with `WrappedTorchNorm` and steps with
`torch.optim.AdamW`; both fallbacks have bugs of their own, found on the CPU (shared/notes/megatron-cpu-probe)
but not CPU-specific: a GPU without TE hits them the same way (tensor parallelism turns sequence parallelism
on, a resumed run loads the optimizer). Without apex, grad-norm clipping loops over the parameters in
Python and reads each parameter's norm on the host (a sync per parameter on CUDA, every step); torch's
foreach kernels replace that loop. A frozen linear's input gradient (LoRA freezes the output layer) ran as a bmm over
its weight copied for every token (see `frozen_weight_dgrad`). `apply_fallback_fixes()` patches them once per
process, before
models are built; each patch only touches the fallback it fixes, so it changes nothing where TE or apex is
used. `engine_megatron.megatron_cpu` adds the CPU-only adaptations on top.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def apply_fallback_fixes() -> list[str]:
    """Apply the fixes once (idempotent); return their names."""
    return [*_patch_torch_norm(), *_patch_moe_router(), *_patch_optimizer_state(), *_patch_multi_tensor_ops(),
            *_patch_frozen_weight_dgrad()]


def _patch_torch_norm() -> list[str]:
    # Without TE/Apex the local spec uses WrappedTorchNorm, which asserts "sequence parallel not supported
    # by torch LayerNorm". A plain torch norm is correct under sequence parallelism as long as its params
    # carry `.sequence_parallel = True`, so finalize_model_grads all-reduces their grads over TP.
    from megatron.core.transformer import torch_norm

    def new(cls: Any, config: Any, hidden_size: int, eps: float = 1e-5, **_unused: Any) -> torch.nn.Module:
        kinds = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}
        if config.normalization not in kinds:
            raise ValueError(f"normalization={config.normalization!r} has no torch norm (without TE or apex); "
                             f"use one of {sorted(kinds)}")
        norm = kinds[config.normalization](hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = bool(config.sequence_parallel)
        return norm

    torch_norm.WrappedTorchNorm.__new__ = new
    return ["torch-norm-sequence-parallel"]


def _patch_moe_router() -> list[str]:
    # megatron-core 0.16.1 bug without transformer-engine: the router tests `te_general_gemm is not None`
    # but the name is only bound when TE imports -> NameError in every MoE router forward.
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    return ["moe-te_general_gemm"]


def _patch_optimizer_state() -> list[str]:
    """DistributedOptimizer with torch.optim.AdamW (megatron's optimizer without Apex/TE) checkpoint bugs."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer as DistOpt

    # (a) Loading a 'fully_reshardable' state copies every Adam state key including 'step', which the
    # loader skipped on purpose (step comes from param_groups) -> KeyError 'step'. Hide 'step' meanwhile.
    orig_set = DistOpt._set_main_param_and_optimizer_states

    def set_states(self: Any, model_param: Any, tensors: dict) -> Any:
        group_index, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group_index]["params"][order]]
        step = state.pop("step", None)
        try:
            return orig_set(self, model_param, {k: v for k, v in tensors.items() if k != "step"})
        finally:
            if step is not None:
                state["step"] = step

    # (b) sharded_state_dict(is_loading=True) on a fresh optimizer reads the lazily created Adam 'step'
    # -> AssertionError `len(steps) == 1`. Pre-create the state; the load overwrites it.
    orig_ssd = DistOpt.sharded_state_dict

    def sharded_state_dict(self: Any, model_sharded_state_dict: Any = None, is_loading: bool = False,
                           *args: Any, **kwargs: Any) -> Any:
        if is_loading and isinstance(self.optimizer, torch.optim.Adam | torch.optim.AdamW):
            for group in self.optimizer.param_groups:
                for param in group["params"]:
                    state = self.optimizer.state[param]
                    if not state:
                        state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(param),
                                     exp_avg_sq=torch.zeros_like(param))
        return orig_ssd(self, model_sharded_state_dict or {}, is_loading, *args, **kwargs)

    # (c) Silent: load_state_dict gives every param the SAME 'step' tensor, so each step() increments it
    # once per param and Adam's bias correction goes wrong. Give each param its own copy.
    orig_load = DistOpt.load_state_dict

    def load_state_dict(self: Any, state_dict: Any) -> Any:
        out = orig_load(self, state_dict)
        for state in self.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()
        return out

    DistOpt._set_main_param_and_optimizer_states = set_states
    DistOpt.sharded_state_dict = sharded_state_dict
    DistOpt.load_state_dict = load_state_dict
    return ["distopt-step-keyerror", "distopt-lazy-adam-state", "distopt-shared-step"]


def foreach_l2_norm(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                    per_tensor: bool, *args: Any) -> tuple[torch.Tensor, None]:
    """megatron's apex-free `local_multi_tensor_l2_norm` without its host reads: that builds
    `torch.tensor(list of 0-d device tensors)` (one device-to-host copy per parameter) and copies the total
    to the host and back. Same result: a (1,) float32 tensor, the l2 norm over every tensor of every list."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device=noop_flag.device), None
    norms = torch.stack(torch._foreach_norm(tensors)).float()
    return torch.linalg.vector_norm(norms).reshape(1), None


def foreach_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: list[list[torch.Tensor]],
                  scale: float) -> None:
    """megatron's apex-free `local_multi_tensor_scale` (dst = src * scale, one pair of ops per tensor) in
    foreach calls; clipping scales the gradients in place (src is dst)."""
    src, dst = tensor_lists
    if all(s is d for s, d in zip(src, dst)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _patch_multi_tensor_ops() -> list[str]:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    patched = []
    if getattr(clip_grads, "l2_norm_impl", None) is utils.local_multi_tensor_l2_norm:  # apex / TE missing
        clip_grads.l2_norm_impl = foreach_l2_norm
        patched.append("clip-grads-foreach-l2-norm")
    if getattr(clip_grads, "multi_tensor_scale_impl", None) is utils.local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = foreach_scale
        patched.append("clip-grads-foreach-scale")
    return patched


def frozen_weight_dgrad(grad_output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """grad_output @ weight as one mm, without copying grad_output. megatron's `LinearWithFrozenWeight` computes
    `grad_output.matmul(weight)`; the output layer's gradient comes back from the [b, s, V] logits as a transposed
    [s, b, V] view, whose leading dims torch 2.13 does not fold, so matmul broadcast the weight to every token and
    ran a bmm (megatron-core 0.16; on the CPU a V x h copy per token: a tiny LoRA model's step took 6.9x as long).
    megatron-core 0.19 reshapes to 2D first, which copies the logits-sized gradient when a micro-batch has several
    padded rows (b > 1). Here the view is turned back: no copy either way."""
    if grad_output.dim() == 3 and not grad_output.is_contiguous() and grad_output.transpose(0, 1).is_contiguous():
        return torch.matmul(grad_output.transpose(0, 1), weight).transpose(0, 1)
    return torch.matmul(grad_output.reshape(-1, grad_output.size(-1)), weight).view(*grad_output.shape[:-1], -1)


def _patch_frozen_weight_dgrad() -> list[str]:
    from megatron.core.tensor_parallel import layers

    @staticmethod
    @layers.custom_bwd
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (weight,) = ctx.saved_tensors
        grad_input = frozen_weight_dgrad(grad_output, weight)
        if ctx.allreduce_dgrad:
            torch.distributed.all_reduce(grad_input, group=ctx.tp_group)
        return grad_input, None, None, None, None

    layers.LinearWithFrozenWeight.backward = backward
    return ["frozen-weight-dgrad-mm"]
