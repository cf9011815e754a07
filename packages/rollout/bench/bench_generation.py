"""Tokens/s of the torch generation backend vs Hugging Face `generate` on the same batch.

Both sample (T = 1, no top-k / top-p) `--prompts` x `--samples` completions of up to `--max-new` tokens
from the same tiny checkpoint, on CPU with `--threads` threads. Counted tokens are the useful ones: each
completion up to and including its stop token. HF gets the prompts left-padded and `num_return_sequences`.

    uv run python packages/rollout/bench/bench_generation.py [--prompts 32 --samples 8 --max-new 128]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from rl_core.interfaces import SamplingParams
from rl_core.testing.tiny_models import build_tokenizer, save_tiny_checkpoint
from rollout.torch_backend import TorchGenerationBackend

# tiny-h128: 2 layers, hidden 128 (the test model); small-h512: 4 layers, hidden 512, head_dim 64.
MODELS = {
    "tiny-h128": {},
    "small-h512": dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=4),
}
EOS = 2


def _prompts(num: int) -> list[list[int]]:
    tok = build_tokenizer()
    texts = [f"Question {i}: what is {i} * {3 * i + 1}?" + " think" * (i % 5) for i in range(num)]
    return [[tok.bos_token_id] + tok.encode(t, add_special_tokens=False) for t in texts]


def _useful(rows: torch.Tensor) -> int:
    """Tokens up to and including the first EOS of each row (B, T)."""
    total = 0
    for row in rows.tolist():
        total += row.index(EOS) + 1 if EOS in row else len(row)
    return total


def bench_hf(path: str, prompts: list[list[int]], n: int, max_new: int) -> tuple[int, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    attn = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_new, num_return_sequences=n, eos_token_id=EOS, pad_token_id=0)
    seconds = time.perf_counter() - start
    return _useful(out[:, width:]), seconds


def bench_backend(path: str, prompts: list[list[int]], n: int, max_new: int) -> tuple[int, float]:
    backend = TorchGenerationBackend(path)
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, seed=0)
    start = time.perf_counter()
    out = backend.generate(prompts, params)
    seconds = time.perf_counter() - start
    return sum(len(c.token_ids) for c in out), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of: " + ", ".join(MODELS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompts = _prompts(args.prompts)
    print(f"batch: {args.prompts} prompts x {args.samples} samples, max_new_tokens={args.max_new}, "
          f"threads={args.threads}")
    print(f"{'model':18} {'impl':14} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'speedup':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            path = str(save_tiny_checkpoint(f"{tmp}/{len(name)}", "qwen2", seed=0, **MODELS[name]))
            hf_tokens, hf_s = bench_hf(path, prompts, args.samples, args.max_new)
            tb_tokens, tb_s = bench_backend(path, prompts, args.samples, args.max_new)
            hf_rate, tb_rate = hf_tokens / hf_s, tb_tokens / tb_s
            print(f"{name:18} {'hf generate':14} {hf_tokens:7d} {hf_s:8.2f} {hf_rate:8.0f} {1.0:8.2f}")
            print(f"{name:18} {'torch backend':14} {tb_tokens:7d} {tb_s:8.2f} {tb_rate:8.0f} {tb_rate / hf_rate:8.2f}")


if __name__ == "__main__":
    main()
