"""sdpa_segments: per-sequence causal attention over a packed row, checked against a float64 softmax."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from engine_dtensor.attention import segment_sdpa_forward
from engine_dtensor.forward import build_packed_inputs
from seqpack.testing import reference_packed_attention


class _OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.shapes: set[tuple[str, tuple[int, ...]]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.shapes.add((str(func), tuple(out.shape)))
        return out


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: list[int], window: int | None) -> torch.Tensor:
    """seqpack's float64 reference in HF's layout: (1, H, T, D) in, (1, T, H, D) out."""
    return reference_packed_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, window)[None]


@pytest.mark.parametrize("window", [None, 4, 100])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_segment_attention_matches_float64_reference(heads: int, kv_heads: int, window: int | None) -> None:
    torch.manual_seed(0)
    cu = [0, 5, 6, 19, 32]  # includes a 1-token segment
    q = torch.randn(1, heads, 32, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, 32, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, 32, 8, dtype=torch.float64, requires_grad=True)
    module = nn.Module().eval()
    cu_t = torch.tensor(cu, dtype=torch.int32)
    out, _ = segment_sdpa_forward(module, q, k, v, None, cu_seq_lens_q=cu_t, sliding_window=window)
    ref = _reference(q, k, v, cu, window)
    assert out.shape == (1, 32, heads, 8)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    seed = torch.Generator().manual_seed(1)
    weight = torch.randn(out.shape, generator=seed, dtype=torch.float64)
    with _OpNames() as backward_ops:
        grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    # the row's q/k/v enter as views whose backward is a view too (a select's allocates and copies)
    assert ("aten.select_backward.default", tuple(q.shape)) not in backward_ops.shapes
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-10)


def test_segments_must_cover_the_row() -> None:
    q = torch.zeros(1, 2, 10, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens ends at 8"):
        segment_sdpa_forward(nn.Module(), q, q, q, None, cu_seq_lens_q=torch.tensor([0, 3, 8]))


def test_packed_inputs_give_segments_not_a_mask() -> None:
    """Each sequence with its padding is one segment and the tail padding is the last one."""
    seqs = [torch.arange(5), torch.arange(3), torch.arange(6)]
    inputs = build_packed_inputs(seqs, attn_impl="sdpa_segments", seq_multiple=4, device=torch.device("cpu"))
    assert inputs.attention_mask is None
    assert inputs.attention_kwargs["cu_seq_lens_q"].tolist() == [0, 5, 8, 14, 16]
    assert inputs.input_ids.shape == (1, 16)


@pytest.mark.parametrize("sliding", [False, True])
def test_packed_forward_builds_no_token_by_token_mask(sliding: bool) -> None:
    """HF would build a (1, 1, T, T) mask from the position ids of a packed row (and read a device tensor
    to detect the packing): nothing uses it, so no tensor of T x T elements may appear, forward or backward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from engine_dtensor.attention import SEGMENT_SDPA
    from engine_dtensor.forward import forward_logprobs
    from rl_core.testing.memory import LargestTensors

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=sliding,
                         sliding_window=16, max_window_layers=1)
    config._attn_implementation = SEGMENT_SDPA
    model = Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 64, (n,), generator=gen) for n in (90, 60, 120, 26)]
    inputs = build_packed_inputs(seqs, attn_impl=SEGMENT_SDPA, seq_multiple=1, device=torch.device("cpu"))
    total = inputs.input_ids.shape[1]
    with LargestTensors() as seen:
        logprobs, _ = forward_logprobs(model, inputs, temperature=1.0, with_entropy=False)
        logprobs.sum().backward()
    largest = max(numel for numel, _, _ in seen.largest.values())
    assert largest < total * total // 4, seen.largest
