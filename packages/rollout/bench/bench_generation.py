"""Tokens/s of the torch generation backend (dense and paged decode) vs Hugging Face `generate`, same batch.

Every implementation samples (T = 1, no top-k / top-p) `--prompts` x `--samples` completions of up to
`--max-new` tokens from the same locally built checkpoint. Counted tokens are the useful ones: each
completion up to and including its stop token. HF gets the prompts left-padded and `num_return_sequences`.

CPU (default): tiny qwen2 shapes, float32, `--threads` threads, the prompts of the toy tokenizer.

    uv run python packages/rollout/bench/bench_generation.py [--prompts 32 --samples 8 --max-new 128]

CUDA: Qwen2.5-0.5B and -1.5B shapes (random weights, std 0.02, tied embeddings), bfloat16, 64 random
prompts of 32-160 tokens x 8 samples x 256 new tokens; also ms per decode step at full batch (paged) and
peak GPU memory. ms per decode step covers the whole step (forward, sampling inside it, the host copies
of the sampled tokens), timed at the largest batch of the run.

    uv run python packages/rollout/bench/bench_generation.py --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

from rl_core.interfaces import SamplingParams
from rl_core.testing.tiny_models import build_tokenizer, save_tiny_checkpoint, tiny_config
from rollout.torch_backend import TorchGenerationBackend

# tiny-h128: 2 layers, hidden 128 (the test model); small-h512: 4 layers, hidden 512, head_dim 64.
CPU_MODELS = {
    "tiny-h128": {},
    "small-h512": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4),
}
QWEN_VOCAB = 151936
GPU_MODELS = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2),
}
EOS = 2
IMPLS = ("hf", "dense", "paged")


def toy_prompts(num: int) -> list[list[int]]:
    tok = build_tokenizer()
    texts = [f"Question {i}: what is {i} * {3 * i + 1}?" + " think" * (i % 5) for i in range(num)]
    return [[tok.bos_token_id] + tok.encode(t, add_special_tokens=False) for t in texts]


def random_prompts(num: int, vocab: int, lengths: tuple[int, int] = (32, 160)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (num,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in sizes]


def qwen_checkpoint(path: str, shape: dict[str, Any]) -> str:
    """A Qwen2.5-shaped checkpoint with HF's own init (normal, std 0.02), bfloat16, tied embeddings."""
    from transformers import AutoModelForCausalLM

    config = tiny_config("qwen2", vocab_size=QWEN_VOCAB, tie_word_embeddings=True, max_position_embeddings=32768,
                         rope_theta=1000000.0, initializer_range=0.02, **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    return path


def _useful(rows: torch.Tensor) -> int:
    """Tokens up to and including the first EOS of each row (B, T)."""
    total = 0
    for row in rows.tolist():
        total += row.index(EOS) + 1 if EOS in row else len(row)
    return total


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench_hf(path: str, prompts: list[list[int]], n: int, max_new: int, device: str, dtype: str) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    attn = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    torch.manual_seed(0)
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=attn.to(device), do_sample=True, temperature=1.0, top_k=0,
                             top_p=1.0, max_new_tokens=max_new, num_return_sequences=n, eos_token_id=EOS,
                             pad_token_id=0)
    _sync(device)
    seconds = time.perf_counter() - start
    del model
    return dict(tokens=_useful(out[:, width:].cpu()), seconds=seconds)


def bench_backend(path: str, prompts: list[list[int]], n: int, max_new: int, device: str, dtype: str,
                  decode: str, max_num_seqs: int) -> dict:
    backend = TorchGenerationBackend(path, device=device, dtype=dtype, decode=decode, max_num_seqs=max_num_seqs,
                                     eos_token_ids=[EOS])
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, seed=0)
    if decode == "paged" and device == "cuda":  # capture the graphs (every bucket and width) outside the timed run
        backend.generate(prompts, SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, seed=1))
    step_ms: list[tuple[int, float]] = []
    if decode == "paged":  # time each decode step (the scheduler syncs every step anyway)
        inner = backend.decoder.decode

        def timed(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
            begin = time.perf_counter()
            sampled = inner(*args)  # tokens (rows,), logprobs (rows,): sampling is part of the step
            _sync(device)
            step_ms.append((sampled[0].shape[0], 1000 * (time.perf_counter() - begin)))
            return sampled

        backend.decoder.decode = timed  # type: ignore[method-assign]
    _sync(device)
    start = time.perf_counter()
    out = backend.generate(prompts, params)
    _sync(device)
    seconds = time.perf_counter() - start
    full = [ms for rows, ms in step_ms if rows == max(r for r, _ in step_ms)] if step_ms else []
    result = dict(tokens=sum(len(c.token_ids) for c in out), seconds=seconds,
                  step_ms=statistics.median(full) if full else None,
                  step_rows=max((r for r, _ in step_ms), default=None))
    del backend
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--prompts", type=int, default=None, help="default: 32 on CPU, 64 on CUDA")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=None, help="default: 128 on CPU, 256 on CUDA")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-num-seqs", type=int, default=512)
    parser.add_argument("--models", default=None, help="comma-separated subset of: "
                        + ", ".join([*CPU_MODELS, *GPU_MODELS]))
    parser.add_argument("--impls", default=None, help="comma-separated subset of: hf, dense, paged "
                        "(default: all on CPU; hf, paged on CUDA)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    num_prompts = args.prompts or (64 if cuda else 32)
    max_new = args.max_new or (256 if cuda else 128)
    models = (args.models or ",".join(GPU_MODELS if cuda else CPU_MODELS)).split(",")
    impls = (args.impls or ("hf,paged" if cuda else ",".join(IMPLS))).split(",")
    dtype = "bfloat16" if cuda else "float32"
    torch.set_num_threads(args.threads)
    print(f"device {args.device} ({torch.cuda.get_device_name() if cuda else f'{args.threads} threads'}), {dtype}: "
          f"{num_prompts} prompts x {args.samples} samples, max_new_tokens={max_new}")
    print(f"{'model':14} {'impl':14} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs HF':>6} {'ms/step':>8} "
          f"{'rows':>5} {'peak GiB':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            if name in GPU_MODELS:
                path, prompts = qwen_checkpoint(f"{tmp}/{name}", GPU_MODELS[name]), random_prompts(num_prompts,
                                                                                                  QWEN_VOCAB)
            else:
                path, prompts = str(save_tiny_checkpoint(f"{tmp}/{name}", "qwen2", seed=0, **CPU_MODELS[name])), \
                    toy_prompts(num_prompts)
            hf_rate = None
            for impl in impls:
                if cuda:
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats()
                if impl == "hf":
                    r = bench_hf(path, prompts, args.samples, max_new, args.device, dtype)
                else:
                    r = bench_backend(path, prompts, args.samples, max_new, args.device, dtype, impl,
                                      args.max_num_seqs)
                rate = r["tokens"] / r["seconds"]
                hf_rate = rate if impl == "hf" else hf_rate
                label = {"hf": "hf generate", "dense": "torch dense", "paged": "torch paged"}[impl]
                ratio = f"{rate / hf_rate:6.2f}" if hf_rate else f"{'-':>6}"
                step = f"{r['step_ms']:8.2f}" if r.get("step_ms") else f"{'-':>8}"
                rows = f"{r['step_rows']:5d}" if r.get("step_rows") else f"{'-':>5}"
                peak = f"{torch.cuda.max_memory_allocated() / 2**30:8.2f}" if cuda else f"{'-':>8}"
                print(f"{name:14} {label:14} {r['tokens']:7d} {r['seconds']:8.2f} {rate:8.0f} {ratio} {step} "
                      f"{rows} {peak}", flush=True)


if __name__ == "__main__":
    main()
