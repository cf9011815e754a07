"""Each backend's `check_options` holds the value rules of its constructor: the constructor raises exactly
its message, before it loads anything, and a launcher can call it without a model, a device or vLLM."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollout.torch_backend import TorchGenerationBackend
from rollout.vllm_backend import VLLMGenerationBackend

MISSING = "/nonexistent/checkpoint"  # a constructor that loaded before checking would raise OSError instead

TORCH_CASES = [
    ({"block_size": 0}, "block_size=0 must be >= 1"),
    ({"block_size": -4}, "block_size=-4 must be >= 1"),
    ({"max_num_seqs": 0}, "max_num_seqs=0 must be >= 1"),
    ({"max_batch_tokens": 0}, "max_batch_tokens=0 must be >= 1"),
    ({"max_prefill_tokens": 0}, "max_prefill_tokens=0 must be >= 1"),
    ({"kv_cache_tokens": -8}, "kv_cache_tokens=-8 must be >= block_size (16), or null to size the cache per call"),
    ({"kv_cache_tokens": 8, "block_size": 32}, "kv_cache_tokens=8 must be >= block_size (32)"),
    ({"compact_fraction": 0.0}, "compact_fraction=0.0 must be in (0, 1]"),
    ({"compact_fraction": 1.5}, "compact_fraction=1.5 must be in (0, 1]"),
    ({"dtype": "fp16"}, "dtype='fp16' must be one of ['bfloat16', 'float16', 'float32']"),
    ({"decode": "fast"}, "decode='fast' must be one of ['auto', 'paged', 'dense']"),
    ({"device": "gpu"}, "device='gpu' must be a torch device string such as 'cpu', 'cuda' or 'cuda:1' (Expected one"),
    ({"device": "cuda:x"}, "device='cuda:x' must be a torch device string"),
    ({"eos_token_ids": [2, -1]}, "eos_token_ids=[2, -1] must be token ids >= 0"),
    ({"batch_buckets": []}, "batch_buckets=[] must be a non-empty list of batch sizes >= 1"),
    ({"batch_buckets": [0, 4]}, "batch_buckets=[0, 4] must be a non-empty list of batch sizes >= 1"),
    ({"attn_implementation": "spda"}, "attn_implementation='spda' must be one of ["),
]


def test_torch_check_options_accepts_what_the_constructor_runs_with():
    TorchGenerationBackend.check_options({})  # every default
    TorchGenerationBackend.check_options({"kv_cache_tokens": 8, "block_size": 4})
    TorchGenerationBackend.check_options(dict(
        dtype="bfloat16", device="cuda:1", max_num_seqs=1, max_batch_tokens=None, compact_fraction=1.0,
        eos_token_ids=[0, 2], decode="paged", block_size=1, kv_cache_tokens=None, batch_buckets=[1, 3],
        max_prefill_tokens=1))
    for name in ("eager", "sdpa", "rollout_sdpa", "flash_attention_2", "kernels-community/flash-attn2"):
        TorchGenerationBackend.check_options({"attn_implementation": name})


def test_attn_implementation_typo_names_the_closest():
    with pytest.raises(ValueError, match=r"attn_implementation='spda' must be one of \[.*'sdpa'.*\] or a Hub kernel "
                                         r"'org/repo'; did you mean 'sdpa'\?"):
        TorchGenerationBackend.check_options({"attn_implementation": "spda"})


VLLM_CASES = [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size=0 must be >= 1"),
    ({"dtype": "fp16"}, "dtype='fp16' must be one of ['auto', 'half', 'float16', 'bfloat16', 'float', 'float32']"),
    ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization=0.0 must be in (0, 1]"),
    ({"gpu_memory_utilization": 1.2}, "gpu_memory_utilization=1.2 must be in (0, 1]"),
    ({"refit": "tensor"}, "refit='tensor' must be one of ['auto', 'tensors', 'path']"),
]
CASES = [(TorchGenerationBackend, *case) for case in TORCH_CASES] + [(VLLMGenerationBackend, *case) for case in VLLM_CASES]


@pytest.mark.parametrize("backend, options, message", CASES, ids=[f"{b.__name__[:5]}-{m.split('=')[0]}" for b, _, m in CASES])
def test_constructor_raises_the_check_options_message_before_loading(backend, options, message):
    """The constructor refuses what the hook refuses, with its message, before it loads a model (the torch backend)
    or imports vLLM (the same ValueError with and without vLLM installed)."""
    with pytest.raises(ValueError) as from_hook:
        backend.check_options(options, prefix="generation.backend_kwargs.")
    assert str(from_hook.value).startswith(f"generation.backend_kwargs.{message}"), from_hook.value
    with pytest.raises(ValueError) as from_constructor:
        backend(MISSING, **options)
    assert str(from_constructor.value) == str(from_hook.value).replace("generation.backend_kwargs.",
                                                                      f"{backend.__name__} ")


def test_vllm_check_options_leaves_its_own_keywords_and_unbounded_values_to_vllm():
    VLLMGenerationBackend.check_options({})
    VLLMGenerationBackend.check_options(dict(tensor_parallel_size=2, dtype="half", gpu_memory_utilization=1.0,
                                             refit="path", seed=-1, max_model_len=None, enforce_eager=True))


def test_check_options_imports_neither_vllm_nor_initialises_cuda():
    """What the trainer's preflight pays: a fresh process checks both backends' options."""
    code = ("import sys, torch\n"
            "from rollout.torch_backend import TorchGenerationBackend as T\n"
            "from rollout.vllm_backend import VLLMGenerationBackend as V\n"
            "T.check_options(dict(device='cuda:0', dtype='bfloat16', block_size=32, attn_implementation='sdpa'))\n"
            "V.check_options(dict(tensor_parallel_size=2, gpu_memory_utilization=0.8))\n"
            "assert 'vllm' not in sys.modules and not torch.cuda.is_initialized(), sorted(sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
