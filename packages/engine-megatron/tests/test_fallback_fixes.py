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

import torch


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


def test_foreach_clip_grad_ops_equal_megatrons_without_host_reads() -> None:
    """Without apex, megatron's grad-norm clipping reads every parameter's norm on the host (a CUDA sync per
    parameter, every step). The foreach replacements give megatron's results with no host read, and
    `apply_fallback_fixes` installs them where megatron took its apex-free fallbacks."""
    import torch
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine_megatron.fallback_fixes import apply_fallback_fixes, foreach_l2_norm, foreach_scale
    from engine_megatron.megatron_cpu import cpu_device_context, ensure_cpu_compat

    class HostReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    ensure_cpu_compat()  # megatron's version allocates on "cuda"
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen) for shape in ((7, 5), (5,), (3, 4, 2), (1,))]
    flag = torch.zeros(1, dtype=torch.int)
    with cpu_device_context(), HostReads() as theirs_reads:
        theirs, _ = utils.local_multi_tensor_l2_norm(2048, flag, [grads[:2], grads[2:]], False)
    with HostReads() as ours_reads:
        ours, _ = foreach_l2_norm(2048, flag, [grads[:2], grads[2:]], False)
    reference = torch.cat([g.double().flatten() for g in grads]).norm()
    assert ours.shape == theirs.shape == (1,) and ours.dtype == theirs.dtype == torch.float32
    assert abs(float(ours) - float(reference)) < 1e-6 * float(reference) and torch.allclose(ours, theirs, rtol=1e-6)
    # megatron's: `float(total)`, plus one copy per parameter in `torch.tensor(list of 0-d tensors)`, which
    # a dispatch mode does not see on CPU tensors
    assert theirs_reads.count >= 1 and ours_reads.count == 0
    assert float(foreach_l2_norm(2048, flag, [[]], False)[0]) == 0.0

    expected = [g * 0.3 for g in grads]
    in_place = [g.clone() for g in grads]
    foreach_scale(2048, flag, [in_place, in_place], 0.3)
    copied = [torch.empty_like(g) for g in grads]
    foreach_scale(2048, flag, [grads, copied], 0.3)
    assert all(torch.equal(a, e) and torch.equal(b, e) for a, b, e in zip(in_place, copied, expected))

    fixes = apply_fallback_fixes()
    assert {"clip-grads-foreach-l2-norm", "clip-grads-foreach-scale"} <= set(fixes)
    assert clip_grads.l2_norm_impl is foreach_l2_norm and clip_grads.multi_tensor_scale_impl is foreach_scale


def test_megatrons_fallback_warnings_are_not_printed_once_the_engine_is_imported() -> None:
    """megatron-core warns at import (once per module, in every process: the driver and each rank) that it falls
    back to torch without TE / apex; the engine logs its resolved attention and fusions instead. In a fresh
    interpreter with Python's default filters: printed without the engine package, not with it."""
    script = textwrap.dedent("""
        import sys
        if sys.argv[1] == "engine":
            import engine_megatron
        import megatron.core.optimizer
        from megatron.core.models.gpt import gpt_layer_specs
        gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    """)
    stderr = {mode: subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True,
                                   check=True).stderr for mode in ("bare", "engine")}
    for fallback in ("Transformer Engine and Apex are not installed", "Apex is not installed"):
        assert fallback in stderr["bare"] and fallback not in stderr["engine"], (fallback, stderr["engine"][-2000:])


def test_a_frozen_output_layers_input_gradient_is_one_mm_without_copies() -> None:
    """LoRA freezes the output layer, whose input gradient megatron computes in `LinearWithFrozenWeight`; the logits'
    gradient reaches it as a transposed view ([b, s, V] -> [s, b, V], two padded rows here). Patched: no bmm over a
    per-token copy of the weight (megatron-core 0.16), no copy of the logits-sized gradient (0.19 reshapes it), and
    the float64 product."""
    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight
    from torch.utils._python_dispatch import TorchDispatchMode

    from engine_megatron.fallback_fixes import apply_fallback_fixes

    assert "frozen-weight-dgrad-mm" in apply_fallback_fixes()
    tokens, hidden, vocab = 37, 16, 1000
    weight = torch.randn(vocab, hidden)
    x = torch.randn(tokens, 2, hidden, requires_grad=True)
    logits = LinearWithFrozenWeight.apply(x, weight, None, False, None).transpose(0, 1).contiguous()  # as GPTModel
    grad_logits = torch.randn(2, tokens, vocab)

    class Ops(TorchDispatchMode):
        seen: list[tuple[str, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            out = func(*args, **(kwargs or {}))
            self.seen.append((str(func), out.numel() if isinstance(out, torch.Tensor) else 0))
            return out

    with Ops():
        logits.backward(grad_logits)
    assert not [op for op, _ in Ops.seen if "bmm" in op], Ops.seen
    assert not [(op, n) for op, n in Ops.seen if ("copy" in op or "clone" in op) and n >= tokens * vocab], Ops.seen
    expected = (grad_logits.double().transpose(0, 1) @ weight.double()).float()
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-4)  # fp32 sums of 1000 products ~30
