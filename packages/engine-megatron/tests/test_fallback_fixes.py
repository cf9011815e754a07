"""megatron's no-TE/apex fallbacks are fixed on a GPU too, not only where the CPU patches apply.

These fixes used to be part of the CPU compatibility layer, which does nothing when CUDA is available: a GPU
without transformer-engine failed to build a model with tensor parallelism (sequence parallel turns on and
`WrappedTorchNorm` asserts) and to resume its torch AdamW state. Checked in a fresh interpreter that
reports CUDA as available.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_fallback_fixes_apply_when_cuda_is_available() -> None:
    script = textwrap.dedent("""
        import torch
        torch.cuda.is_available = lambda: True  # as on a GPU machine without TE or apex
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.moe import moe_utils
        from megatron.core.transformer.torch_norm import WrappedTorchNorm
        from engine_megatron.fallback_fixes import apply_fallback_fixes
        from engine_megatron.megatron_cpu import ensure_cpu_compat

        assert ensure_cpu_compat() == [], "the CPU adaptations must stay off with CUDA"
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, normalization="RMSNorm",
                                   tensor_model_parallel_size=2, sequence_parallel=True, use_cpu_initialization=True)
        try:
            WrappedTorchNorm(config, 8)
        except AssertionError:
            print("unfixed norm asserts")
        print(apply_fallback_fixes())
        norm = WrappedTorchNorm(config, 8, eps=1e-6)
        assert isinstance(norm, torch.nn.RMSNorm) and all(p.sequence_parallel for p in norm.parameters())
        assert moe_utils.te_general_gemm is None
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == "unfixed norm asserts"  # the bug is megatron's, on any device
    assert "torch-norm-sequence-parallel" in lines[1] and "distopt-shared-step" in lines[1]
    assert lines[-1] == "ok"
