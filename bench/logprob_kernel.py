"""The logprob + entropy kernel of both engines against the plain torch composition, side by side.

    uv run bench/logprob_kernel.py [--tokens 2048] [--vocab 151936] [--temperature 1.0] [--device cpu|cuda]
                                   [--top-k 50] [--top-p 0.9]

The same logits (tokens x vocab, model dtype, e.g. bf16 as the engines' lm_head returns them), targets and
upstream gradient go through:
  * plain torch: `log_softmax(logits.float() / T)` gathered at the targets (autograd backward) and the
    entropy `-(softmax * log_softmax).sum(-1)` (what trainers built on plain torch / HF compute);
  * rl_core.logprobs.vocab_parallel_logprobs(with_entropy=True): the kernel of engine-dtensor and
    engine-megatron (token chunks of `policy.logprob_chunk_tokens`, one pass for logprobs and entropy,
    backward recomputing each chunk's softmax into one gradient tensor);
  * the same kernel with --top-k / --top-p (policy.top_k / top_p: the sampler's truncated distribution, whose
    cut costs a sort of each row): what truncation adds (its results are of another distribution, so no
    difference is printed for it).
For each: forward + backward wall time (median of --repeats after a warm-up), the bytes its operators read
and write on tokens x vocab tensors (counted per operator by a TorchDispatchMode: inputs + outputs of every
op with a vocab-wide operand, views free, gather / scatter counted at the elements they touch; a
proxy for the memory traffic that bounds these elementwise passes on a GPU; on CPU torch's softmax kernels
first convert bf16 input to a float32 copy, 12 bytes per element that CUDA's kernels do not move), the most
bytes the tokens x vocab tensors it created held at once (the gradient included), and on CUDA the peak
memory above the inputs. Results agree to the printed max |difference|.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from _common import markdown_table, setup_logging
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from rl_core.logprobs import DEFAULT_LOGPROB_CHUNK_TOKENS, vocab_parallel_logprobs
from rl_core.testing.memory import PeakLiveTensors

# index-driven ops touch one element per row of their vocab-wide operand, not the row
SPARSE_OPS = ("aten.gather", "aten.scatter_add", "aten.scatter", "aten.index")


class VocabTraffic(TorchDispatchMode):
    """Bytes read + written by operators on tensors whose last dim is the vocabulary (see module doc)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.bytes = vocab, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = str(func)
        schema = func._schema
        is_view = bool(schema.returns and schema.returns[0].alias_info is not None
                       and not schema.returns[0].alias_info.is_write)
        tensors = [t for t in tree_flatten((args, kwargs or {}, out))[0] if isinstance(t, torch.Tensor)]
        if not is_view and any(t.dim() and t.shape[-1] == self.vocab for t in tensors):
            for t in tensors:
                wide = t.dim() and t.shape[-1] == self.vocab
                if wide and name.startswith(SPARSE_OPS):
                    continue  # counted at the index / source tensor, which is one element per row
                self.bytes += t.numel() * t.element_size()
        return out


def plain_torch(logits: torch.Tensor, targets: torch.Tensor, chunk: int, temperature: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    logp = torch.log_softmax(logits.float() / temperature, -1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, targets[:, None])[:, 0], entropy


def fused(logits: torch.Tensor, targets: torch.Tensor, chunk: int, temperature: float
          ) -> tuple[torch.Tensor, torch.Tensor]:
    return vocab_parallel_logprobs(logits, targets, temperature=temperature, chunk_tokens=chunk, with_entropy=True)


def truncated(top_k: int, top_p: float) -> Callable:
    def kernel(logits: torch.Tensor, targets: torch.Tensor, chunk: int, temperature: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab_parallel_logprobs(logits, targets, temperature=temperature, chunk_tokens=chunk, with_entropy=True,
                                       top_k=top_k, top_p=top_p)
    return kernel


def measure(fn: Callable, logits: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor, chunk: int,
            temperature: float, repeats: int) -> dict[str, Any]:
    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        leaf = logits.detach().requires_grad_()
        lp, entropy = fn(leaf, targets, chunk, temperature)
        lp.backward(grad)
        return lp.detach(), entropy, leaf.grad

    run()  # warm-up
    times = []
    for _ in range(repeats):
        if logits.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = run()
        if logits.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = float("nan")
    if logits.is_cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    vocab = logits.shape[-1]
    with VocabTraffic(vocab) as traffic, PeakLiveTensors(last_dim=vocab) as live:
        run()
    return {"time": statistics.median(times), "bytes": traffic.bytes, "live": live.peak_bytes,
            "peak": peak, "result": result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk", type=int, default=DEFAULT_LOGPROB_CHUNK_TOKENS)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--top-k", type=int, default=50, help="0 and --top-p 1 leave out the truncated row")
    parser.add_argument("--top-p", type=float, default=0.9)
    args = parser.parse_args()
    setup_logging()
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, generator=gen) * 2).to(getattr(torch, args.dtype)).to(args.device)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=gen).to(args.device)
    grad = torch.randn(args.tokens, generator=gen).to(args.device)
    sides = {"plain torch (log_softmax + entropy, autograd)": plain_torch,
             f"rl_core vocab_parallel_logprobs (chunks of {args.chunk})": fused}
    if args.top_k or args.top_p < 1.0:
        sides[f"the same, top_k={args.top_k} top_p={args.top_p}"] = truncated(args.top_k, args.top_p)
    results = {name: measure(fn, logits, targets, grad, args.chunk, args.temperature, args.repeats) for name, fn in sides.items()}
    base = next(iter(results.values()))
    rows = []
    for name, r in results.items():
        diff = "/".join(f"{float((a.double() - b.double()).abs().max()):.0e}" for a, b in zip(r["result"], base["result"]))
        diff = "(another distribution)" if name.startswith("the same, top_k") else diff
        rows.append([name, f"{r['time'] * 1e3:.1f}", f"{base['time'] / r['time']:.2f}x", f"{r['bytes'] / 2**30:.2f}",
                     f"{base['bytes'] / r['bytes']:.2f}x", f"{r['live'] / 2**30:.2f}", f"{r['peak']:.2f}",
                     diff])
    print(f"\n{args.tokens} tokens x vocab {args.vocab}, {args.dtype} logits on {args.device}, T={args.temperature}, "
          "forward (logprobs + entropy) + backward\n")
    print(markdown_table(["implementation", "ms", "speed-up", "GiB moved on tokens x vocab", "less traffic",
                          "peak GiB of tokens x vocab tensors it created", "CUDA peak above inputs GiB",
                          "max |diff| vs plain: logprobs/entropy/grad"], rows))


if __name__ == "__main__":
    main()
