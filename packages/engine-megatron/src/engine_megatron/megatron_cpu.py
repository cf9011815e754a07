"""Make megatron-core 0.16 run on a CPU-only torch under gloo (tests, CPU conversion checks).

megatron-core assumes CUDA in a few dozen places. `ensure_cpu_compat()` patches exactly those we measured
(shared/notes/megatron-cpu-probe, parts 1 and 2; each patch there was shown to be needed by switching it
off) and does nothing when CUDA is available. `cpu_device_context()` covers the code paths that allocate
on the literal device 'cuda' (optimizer build/step, the forward/backward schedules, DDP buffers); enter it
only around those, it costs a Python call per torch function.

This module owns no model code; it only adapts megatron to the CPU. It must be called before megatron
modules are built (the RNG patches act at construction and forward time). The fixes of megatron's
no-TE/apex fallbacks, which GPUs without TE need too, live in `engine_megatron.fallback_fixes`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from engine_megatron.fallback_fixes import apply_fallback_fixes

logger = logging.getLogger(__name__)

_APPLIED: list[str] | None = None


def ensure_cpu_compat() -> list[str]:
    """Apply the CPU patches once (idempotent), after the fixes every device needs without TE and apex
    (`engine_megatron.fallback_fixes`); return their names. No-op (empty list) with CUDA."""
    global _APPLIED
    if _APPLIED is not None:
        return list(_APPLIED)
    if torch.cuda.is_available():
        _APPLIED = []
        return []
    applied = list(apply_fallback_fixes())
    for patch in (_patch_current_device, _patch_rng_tracker, _patch_causal_masks, _patch_synchronize, _patch_moe):
        applied.extend(patch())
    _APPLIED = applied
    logger.info("megatron-core CPU patches applied: %s", ", ".join(applied))
    return list(applied)


class _CudaAsCpu(TorchFunctionMode):
    """Redirect device='cuda' to the CPU, make Tensor.cuda() a no-op, and report CPU tensors' .type() with
    the 'torch.cuda.' prefix: megatron's optimizers check `param.type() == 'torch.cuda.FloatTensor'`."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_device_context() -> Iterator[None]:
    """Run megatron code that allocates on 'cuda' internally on the CPU; a no-op when CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    ensure_cpu_compat()
    with _CudaAsCpu():
        yield


# --- the patches (each returns the names it applied) -----------------------------------------------------


def _patch_current_device() -> list[str]:
    # ~50 call sites allocate with device=torch.cuda.current_device() (attention's GlobalMemoryBuffer, TP
    # collectives in tensor_parallel/mappings.py, rotary inv_freq, DDP buffers). A CUDA build without a GPU
    # raises "Torch not compiled with CUDA enabled" / "no CUDA GPUs"; point those at the CPU.
    torch.cuda.current_device = lambda: torch.device("cpu")
    return ["current_device->cpu"]


def _patch_rng_tracker() -> list[str]:
    # Dropout in attention and TP layers always enters get_cuda_rng_tracker().fork(), and
    # model_parallel_cuda_manual_seed() seeds the tracker through torch.cuda.get_rng_state. Keep megatron's
    # tracker (so seeding and get/set_states keep working) but store CPU generator states in it.
    from megatron.core.tensor_parallel import random as mrandom

    def add(self: Any, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        gen = torch.Generator()
        gen.manual_seed(seed)
        self.states_[name] = gen.get_state()

    @contextlib.contextmanager
    def fork(self: Any, name: str = mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added (call model_parallel_cuda_manual_seed first)")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)

    mrandom.CudaRNGStatesTracker.add = add
    mrandom.CudaRNGStatesTracker.fork = fork
    # Activation recompute saves/restores the "cuda" RNG state around the recomputed forward; the CPU
    # state and the tracker states are saved separately, so the CUDA part becomes empty.
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    return ["rng-tracker->cpu-generator", "recompute-cuda-rng->noop"]


def _patch_causal_masks() -> list[str]:
    # With attention_mask=None and a causal mask type, the local DotProductAttention builds its mask with
    # helpers that hard-code device="cuda".
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    def causal_mask(sq: int) -> torch.Tensor:  # (sq, sq), True = masked
        return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)

    def sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
        ones = torch.ones(sq, skv, dtype=torch.bool)
        keep = torch.tril(torch.triu(ones, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])
        return ~keep

    for mod in (tutils, fused_softmax):
        if hasattr(mod, "get_default_causal_mask"):
            mod.get_default_causal_mask = causal_mask
        if hasattr(mod, "get_sliding_window_causal_mask"):
            mod.get_sliding_window_causal_mask = sliding_window_mask
    return ["causal-mask->cpu"]


def _patch_synchronize() -> list[str]:
    # torch.cuda.synchronize() is called unconditionally by p2p communication (variable_seq_lengths,
    # batch_p2p_sync) and by dist_checkpointing's torch_dist save; it is not a torch function, so the
    # TorchFunctionMode cannot catch it.
    torch.cuda.synchronize = lambda *a, **k: None
    return ["cuda-synchronize->noop"]


class _CpuEvent:
    def synchronize(self) -> None: ...
    def wait(self, stream: Any = None) -> None: ...
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool:
        return True


class _CpuStream:
    def wait_stream(self, other: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def synchronize(self) -> None: ...
    def record_event(self, event: Any = None) -> _CpuEvent:
        return _CpuEvent()


def _patch_moe() -> list[str]:
    from megatron.core.transformer.moe import token_dispatcher

    # The alltoall dispatcher creates a side CUDA stream in __init__ (skipped when the class attribute is
    # set) and syncs through current_stream()/stream()/events; all tensors are host tensors here.
    default_stream = _CpuStream()
    token_dispatcher.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = _CpuStream()
    torch.cuda.current_stream = lambda device=None: default_stream
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()

    # The dispatcher turns the all-to-all split sizes into numpy arrays only for .is_cuda tensors; gloo's
    # all_to_all_single rejects tensor split sizes ("incompatible function arguments").
    def to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor):
            return tensor.detach().cpu().numpy()
        return tensor

    token_dispatcher.maybe_move_tensor_to_cpu = to_host
    return ["cuda-streams->noop", "moe-split-sizes->numpy"]
