"""`TorchGenerationBackend`: a batched sampler with a KV cache over a Hugging Face causal LM.

The default generation backend where vLLM is not installed (CPU machines, GPUs without vLLM, tests).
Two decode paths behind one interface (`decode=`):

- "paged" (the default on CUDA): a preallocated paged KV cache with prefix sharing (rollout.paged_cache),
  continuous batching (rollout.scheduler) and static-shape decode steps captured in CUDA graphs per
  batch-size bucket (rollout.paged_decoder). Samples are keyed on (seed, row, step).
- "dense" (the default elsewhere; described below): the whole chunk as one left-padded batch through
  the HF forward, a single seeded generator for the chunk.

Owns: the decode loops, stop handling, batch compaction, weight refit and the value rules of its options
(`check_options`, which launchers run before they start anything). Does not own sampling math
(rollout.sampling) or the logprob convention (rl_core.logprobs).

How the dense path stays fast without per-sequence Python loops:
- each prompt is prefilled once and its KV cache is repeated n times (samples share the prefix);
- one decode step is one forward pass over all active rows (per-row positions + attention mask), with a
  KV cache written in place (rollout.kv_cache) and sdpa without K/V head copies (rollout.attention);
- rows that hit a stop token are dropped from the batch and the KV cache as soon as a quarter of the
  active rows are finished, so finished sequences stop costing compute.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal, NoReturn, get_args

import torch
from torch import Tensor

from rl_core.config import closest_key
from rl_core.hf_layout import CheckpointLayout
from rl_core.interfaces import Completion, SamplingParams
from rollout.kv_cache import make_cache
from rollout.paged_decoder import DEFAULT_BUCKETS, PagedDecoder, unsupported
from rollout.sampling import make_generator, sample_next, validate_params
from rollout.scheduler import DEFAULT_MAX_PREFILL_TOKENS, ContinuousBatcher, table_width

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_BLOCK_SIZE = 16
DEFAULT_ATTN_IMPLEMENTATION = "rollout_sdpa"  # rollout.attention.NAME (registered when the backend is built)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


# dense: one padded batch per call; paged: continuous batching over a paged KV cache; auto: paged on CUDA, else dense
Decode = Literal["auto", "paged", "dense"]


class TorchGenerationBackend:
    """rl-core `GenerationBackend` over `AutoModelForCausalLM` with a dynamic KV cache.

    Args:
        model_path: a Hugging Face checkpoint directory.
        dtype: "float32" (default; exact logprobs), "bfloat16" or "float16".
        device: torch device string.
        max_num_seqs: most rows (prompt x sample) decoded together; larger requests run in chunks.
        max_batch_tokens: optional cap on rows x (prompt + max_new_tokens) per chunk (memory bound).
        compact_fraction: drop finished rows once this share of the active rows has finished.
        eos_token_ids: stop tokens added to every request; default: the checkpoint's eos ids.
        attn_implementation: "rollout_sdpa" (sdpa without K/V head copies, rollout.attention) or any
            transformers implementation ("sdpa", "eager"); the dense path only.
        decode: "auto" (paged on CUDA for the models it runs, dense elsewhere), "paged" or "dense".
        block_size: positions per KV cache block (paged).
        kv_cache_tokens: size of the paged KV cache in positions; default: enough for max_num_seqs rows of
            the longest request of each call (grown when a later call needs more).
        batch_buckets: decode batch sizes the paged step is padded to (one CUDA graph per bucket, width and
            sampling parameters).
        cuda_graphs: capture paged decode steps (sampling included) in CUDA graphs (CUDA only).
        max_prefill_tokens: most prompt tokens in one packed prefill forward (paged); the prompts a refill
            admits are prefilled in as few forwards as this allows (a longer prompt runs alone).
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_num_seqs: int = 256,
        max_batch_tokens: int | None = None,
        compact_fraction: float = 0.25,
        eos_token_ids: Sequence[int] | None = None,
        attn_implementation: str = DEFAULT_ATTN_IMPLEMENTATION,
        decode: Decode = "auto",
        block_size: int = DEFAULT_BLOCK_SIZE,
        kv_cache_tokens: int | None = None,
        batch_buckets: Sequence[int] = DEFAULT_BUCKETS,
        cuda_graphs: bool = True,
        max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS,
    ) -> None:
        self.check_options(dict(
            dtype=dtype, device=device, max_num_seqs=max_num_seqs, max_batch_tokens=max_batch_tokens,
            compact_fraction=compact_fraction, eos_token_ids=eos_token_ids, attn_implementation=attn_implementation,
            decode=decode, block_size=block_size, kv_cache_tokens=kv_cache_tokens, batch_buckets=batch_buckets,
            max_prefill_tokens=max_prefill_tokens), prefix=f"{type(self).__name__} ")
        from transformers import AutoModelForCausalLM

        from rollout import attention

        attention.register()
        self.model_path = str(model_path)
        self.dtype = DTYPES[dtype]
        self.device = torch.device(device)
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.compact_fraction = compact_fraction
        self._attn_implementation = attn_implementation
        self.model = AutoModelForCausalLM.from_pretrained(
            self.model_path, dtype=self.dtype, attn_implementation=attn_implementation
        )
        self.model.to(self.device).eval().requires_grad_(False)
        config = self.model.config
        decode = _resolve_decode(decode, self.device, self.model)
        _check_model_support(self.model, attn_implementation, decode, prefix="")
        if eos_token_ids is None:
            gen_cfg = getattr(self.model, "generation_config", None)
            eos_token_ids = _as_id_list(getattr(config, "eos_token_id", None))
            eos_token_ids += _as_id_list(getattr(gen_cfg, "eos_token_id", None))
            if not eos_token_ids:  # neither config names one: the tokenizer's, as vLLM stops on (else: no stop at all)
                from transformers import AutoTokenizer

                eos_token_ids = _as_id_list(AutoTokenizer.from_pretrained(self.model_path).eos_token_id)
        self.eos_token_ids = sorted(set(int(t) for t in eos_token_ids))
        pad = getattr(config, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self._sleep_level = 0
        self.decode = decode
        self._paged_options = dict(block_size=block_size, buckets=batch_buckets, cuda_graphs=cuda_graphs)
        self.kv_cache_tokens = kv_cache_tokens
        self.max_prefill_tokens = max_prefill_tokens
        self.decoder = PagedDecoder(self.model, **self._paged_options) if decode == "paged" else None
        self.last_events: list[tuple[str, int, int]] = []  # paged: ("admit" | "finish", row, step)
        self.last_batch_sizes: list[int] = []  # paged: rows of each decode step
        self.last_prefill_sizes: list[int] = []  # paged: prompt tokens of each packed prefill forward
        logger.info("torch generation backend: %s on %s (%s, %s decode)", self.model_path, self.device, dtype,
                    decode)

    @classmethod
    def check_options(cls, options: Mapping[str, Any], *, prefix: str = "") -> None:
        """ValueError naming `prefix` + the option, its value and what is allowed, for every option value the
        constructor refuses. Needs no model and touches no device, so a launcher can call it before it starts
        anything (the trainer's preflight, with prefix "generation.backend_kwargs."); options left out take
        their defaults. Checks that need the model (paged-path support, soft-capping) stay in the constructor."""
        def fail(name: str, allowed: str) -> NoReturn:
            raise ValueError(f"{prefix}{name}={options[name]!r} must be {allowed}")

        def given(name: str) -> bool:  # None is the default of the optional ones; the others' type check says so
            return options.get(name) is not None

        if "dtype" in options and options["dtype"] not in DTYPES:
            fail("dtype", f"one of {sorted(DTYPES)}")
        if "decode" in options and options["decode"] not in get_args(Decode):
            fail("decode", f"one of {list(get_args(Decode))}")
        if "device" in options:
            try:  # parses only: no CUDA initialisation
                torch.device(options["device"])
            except (RuntimeError, TypeError) as exc:
                fail("device", f"a torch device string such as 'cpu', 'cuda' or 'cuda:1' ({exc})")
        for name in ("max_num_seqs", "max_batch_tokens", "block_size", "max_prefill_tokens"):
            if given(name) and options[name] < 1:
                fail(name, ">= 1")
        block_size = options.get("block_size", DEFAULT_BLOCK_SIZE)
        if given("kv_cache_tokens") and options["kv_cache_tokens"] < block_size:
            fail("kv_cache_tokens", f">= block_size ({block_size}), or null to size the cache per call")
        if "compact_fraction" in options and not 0.0 < options["compact_fraction"] <= 1.0:
            fail("compact_fraction", "in (0, 1]")
        if given("eos_token_ids") and any(int(t) < 0 for t in options["eos_token_ids"]):
            fail("eos_token_ids", "token ids >= 0 (or null: the checkpoint's eos ids)")
        if "batch_buckets" in options and (not options["batch_buckets"] or min(options["batch_buckets"]) < 1):
            fail("batch_buckets", "a non-empty list of batch sizes >= 1")
        if "attn_implementation" in options:
            allowed = _attn_implementation_problem(options["attn_implementation"])
            if allowed:
                fail("attn_implementation", allowed)

    @classmethod
    def check_model(cls, model_path: str, options: Mapping[str, Any], *, prefix: str = "") -> None:
        """ValueError naming `prefix` + the option to change if the checkpoint at `model_path` cannot be generated
        from under `options` (the layouts the paged decode path supports, attention soft-capping). Reads
        config.json and builds the model on the meta device: no weight is read and no device touched, so a
        launcher calls it before it starts anything (the trainer's preflight)."""
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):  # eager: the module layout does not depend on the attention kernel
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path),
                                                     attn_implementation="eager")
        decode = _resolve_decode(options.get("decode", "auto"), torch.device(options.get("device", "cpu")), model)
        _check_model_support(model, options.get("attn_implementation", DEFAULT_ATTN_IMPLEMENTATION), decode,
                             prefix=prefix)

    # ------------------------------------------------------------------ generation
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """`params.n` completions per prompt, prompt-major, each with sampled-token logprobs."""
        if self._sleep_level:
            raise RuntimeError("TorchGenerationBackend.generate called while asleep; call wake() first")
        validate_params(params)
        prompts = [self._check_prompt(i, p) for i, p in enumerate(prompt_token_ids)]
        if not prompts:  # both paths size their caches by the longest prompt
            return []
        if self.decoder is not None:
            return self._generate_paged(prompts, params)
        stop_ids = torch.tensor(sorted(set(self.eos_token_ids) | {int(t) for t in params.stop_token_ids}),
                                dtype=torch.long, device=self.device)
        generator = make_generator(params.seed, self.device)
        completions: list[Completion] = []
        for start, stop, n in self._chunks(prompts, params):
            tokens, logprobs, lengths, stopped = self._generate_chunk(
                prompts[start:stop], replace(params, n=n), stop_ids, generator)
            tokens_l, logprobs_l = tokens.tolist(), logprobs.tolist()
            for row, (length, was_stopped) in enumerate(zip(lengths.tolist(), stopped.tolist())):
                completions.append(Completion(
                    prompt_index=start + row // n,
                    token_ids=tokens_l[row][:length],
                    logprobs=logprobs_l[row][:length],
                    finish_reason="stop" if was_stopped else "length",
                ))
        return completions

    def _generate_paged(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Continuous batching over the paged cache (rollout.scheduler)."""
        decoder, bs = self.decoder, self.decoder.block_size
        rows = min(len(prompts) * params.n, self.max_num_seqs)
        longest = max(len(p) for p in prompts)
        if self.kv_cache_tokens is not None:
            num_blocks = -(-self.kv_cache_tokens // bs) + 1
        else:  # every row at full length + the one prompt whose samples are being admitted (+ null block)
            num_blocks = rows * -(-(longest + params.max_new_tokens - 1) // bs) + -(-longest // bs) + 1
        decoder.reserve(num_blocks=num_blocks, max_rows=rows, table_width=table_width(decoder, prompts, params))
        seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(32)
        stop_ids = set(self.eos_token_ids) | {int(t) for t in params.stop_token_ids}
        batcher = ContinuousBatcher(decoder, prompts, params, stop_ids, max_num_seqs=self.max_num_seqs, seed=seed,
                                    max_prefill_tokens=self.max_prefill_tokens)
        try:
            completions = batcher.run()
        except BaseException:  # an OOM, a bad temperature, Ctrl-C: the next call starts from an empty cache
            decoder.cache.free_all()
            raise
        self.last_events, self.last_batch_sizes = batcher.events, batcher.batch_sizes
        self.last_prefill_sizes = batcher.prefill_sizes
        return completions

    def _check_prompt(self, index: int, prompt: Sequence[int]) -> list[int]:
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt_token_ids[{index}] is empty; every prompt needs at least one token")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"prompt_token_ids[{index}] holds token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})"
            )
        return ids

    def _chunks(self, prompts: list[list[int]], params: SamplingParams) -> Iterable[tuple[int, int, int]]:
        """(start, stop, samples): ranges of prompts and how many samples of each to decode together, so that the
        rows (prompts x samples) fit max_num_seqs / max_batch_tokens. A prompt whose n alone exceeds them is decoded
        alone, its samples in consecutive chunks (completions stay prompt-major)."""
        longest = max(len(p) for p in prompts) + params.max_new_tokens
        rows = self.max_num_seqs
        if self.max_batch_tokens is not None:
            rows = min(rows, max(1, self.max_batch_tokens // longest))
        samples = min(params.n, rows)
        per_chunk = max(1, rows // params.n)
        for start in range(0, len(prompts), per_chunk):
            stop = min(start + per_chunk, len(prompts))
            for done in range(0, params.n, samples):
                yield start, stop, min(samples, params.n - done)

    @torch.inference_mode()
    def _generate_chunk(
        self, prompts: list[list[int]], params: SamplingParams, stop_ids: Tensor, generator: torch.Generator
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Decode one chunk; returns tokens (B, T), logprobs (B, T), lengths (B,), stopped (B,)."""
        n, max_new = params.n, params.max_new_tokens
        num_rows = len(prompts) * n
        dev = self.device
        cache = make_cache(self.model.config, capacity=max(len(p) for p in prompts) + max_new)
        logits, attn = self._prefill(prompts, cache)  # (P, V), (P, Lp)
        if n > 1:  # samples of a prompt share its prefill
            cache.batch_repeat_interleave(n)
            logits, attn = logits.repeat_interleave(n, dim=0), attn.repeat_interleave(n, dim=0)
        next_pos = attn.sum(dim=-1)  # (B,) position of the next token of each row
        rows = torch.arange(num_rows, device=dev)  # original row of each active row
        out_tokens = torch.full((num_rows, max_new), self.pad_token_id, dtype=torch.long, device=dev)
        out_logprobs = torch.zeros((num_rows, max_new), dtype=torch.float32, device=dev)
        lengths = torch.full((num_rows,), max_new, dtype=torch.long, device=dev)
        stopped = torch.zeros(num_rows, dtype=torch.bool, device=dev)
        done = torch.zeros(num_rows, dtype=torch.bool, device=dev)  # per active row
        for step in range(max_new):
            tokens, logprobs = sample_next(logits, params, generator)  # (b,), (b,)
            out_tokens[rows, step] = tokens
            out_logprobs[rows, step] = logprobs
            newly = torch.isin(tokens, stop_ids) & ~done
            lengths[rows[newly]] = step + 1
            stopped[rows[newly]] = True
            done |= newly
            num_done = int(done.sum())
            if step == max_new - 1 or num_done == rows.numel():
                break
            if num_done and num_done >= self.compact_fraction * rows.numel():
                keep = (~done).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                rows, attn, next_pos, tokens = rows[keep], attn[keep], next_pos[keep], tokens[keep]
                done = done[keep]
            attn = torch.cat([attn, attn.new_ones(rows.numel(), 1)], dim=-1)
            out = self.model(input_ids=tokens[:, None], attention_mask=attn, position_ids=next_pos[:, None],
                             past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1, :]
            next_pos = next_pos + 1
        return out_tokens.cpu(), out_logprobs.cpu(), lengths.cpu(), stopped.cpu()

    def _prefill(self, prompts: list[list[int]], cache: Any) -> tuple[Tensor, Tensor]:
        """Left-padded forward of the prompts; returns last-position logits (P, V) and the mask (P, Lp)."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # builds the padded input once per chunk, not per token
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p):] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        positions = (attn.cumsum(dim=-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=attn, position_ids=positions, past_key_values=cache,
                         use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :], attn

    # ------------------------------------------------------------------ refit and memory
    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the model in place.

        Names are the checkpoint's (what `export_hf_weights()` yields); where transformers converts weights
        at load time (MoE experts fused into one tensor, renamed modules) the pieces are assembled into the
        in-memory parameter (rl_core.hf_layout). Strict: an unknown name, a shape mismatch or a fused
        parameter left incomplete raises ValueError. Tensors are checked and copied one at a time
        (streaming), so after an error the weights are partly updated: refit again.
        """
        if self._sleep_level == 2:
            raise RuntimeError("update_weights called after sleep(level=2) discarded the weights; call wake() first")
        if self._sleep_level == 1:  # wake the weights alone, as vLLM's tags=["weights"]: the copies below then
            self.model.to(self.device)  # stay on the device instead of going through pageable host memory
        targets = dict(self.model.named_parameters(remove_duplicate=False))
        targets.update(self.model.named_buffers(remove_duplicate=False))
        layout: CheckpointLayout | None = None  # built on the first converted name only: dense models need none
        count = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in targets:
                    layout = layout or CheckpointLayout(self.model, targets)
                    if layout.owner(name) is None:
                        raise ValueError(
                            f"update_weights: {name!r} is not a weight of {type(self.model).__name__} "
                            f"({self.model_path}); expected Hugging Face names such as {next(iter(targets))!r}"
                        )
                    finished = layout.add(name, tensor.detach())
                    if finished is None:
                        continue
                    name, tensor = finished
                self._copy_weight(targets[name], name, tensor)
                count += 1
        if layout is not None and layout.incomplete():
            raise ValueError(f"update_weights: parts of fused weights were not sent: {layout.incomplete()}")
        logger.debug("update_weights: loaded %d tensors", count)

    @staticmethod
    def _copy_weight(target: Tensor, name: str, tensor: Tensor) -> None:
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}; the model expects "
                             f"{tuple(target.shape)}")
        target.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))

    def sleep(self, level: int = 1) -> None:
        """Release memory: level 1 moves weights to host memory (no-op on CPU); level 2 discards them.

        The paged KV cache and the captured CUDA graphs are freed (the dense path's cache lives only inside
        `generate`). After level 2, `wake()` reloads the checkpoint from `model_path`; refit
        (update_weights) to get the policy back.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep(level={level}); expected 1 (offload weights) or 2 (discard weights)")
        if self.decoder is not None:
            self.decoder.release()
        if level == 2:
            self.model.to("meta")
        elif self.device.type != "cpu":
            self.model.to("cpu")
        self._sleep_level = level
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake(self) -> None:
        """Undo `sleep`: bring the weights back to the device (reloading them after level 2)."""
        if self._sleep_level == 2:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=self.dtype, attn_implementation=self._attn_implementation
            )
            self.model.eval().requires_grad_(False)
        self.model.to(self.device)
        if self.decoder is not None and self.decoder.model is not self.model:
            self.decoder = PagedDecoder(self.model, **self._paged_options)
        self._sleep_level = 0


def _resolve_decode(decode: str, device: torch.device, model: Any) -> str:
    """`auto`: paged on CUDA where the paged path runs the model (paged_decoder.unsupported), else dense."""
    if decode != "auto":
        return decode
    return "paged" if device.type == "cuda" and unsupported(model) is None else "dense"


def _check_model_support(model: Any, attn_implementation: str, decode: str, *, prefix: str) -> None:
    """The loaded (or meta-device) `model` can be generated from with this attention and decode path."""
    _check_softcap_support(model.config, attn_implementation, decode, prefix=prefix)
    problem = unsupported(model) if decode == "paged" else None
    if problem:
        raise ValueError(f"{problem}: set {prefix}decode=dense")


def _check_softcap_support(config: Any, attn_implementation: str, decode: str, *, prefix: str) -> None:
    """Only transformers' eager attention, on the dense path, applies an attention logit soft-cap (Gemma 2);
    any other would sample from another model than the checkpoint's."""
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None and (attn_implementation != "eager" or decode != "dense"):
        raise ValueError(
            f"the model soft-caps its attention logits (attn_logit_softcapping={softcap}), which only eager attention "
            f"on the dense decode path applies; got attn_implementation={attn_implementation!r}, decode={decode!r}: set "
            f"{prefix}attn_implementation=eager and {prefix}decode=dense")


def _attn_implementation_problem(name: Any) -> str | None:
    """What is allowed, unless `name` is one transformers accepts at load time: eager, a registered
    implementation (ours included), or a Hub kernel 'org/repo' (transformers fetches and checks it then)."""
    from transformers import AttentionInterface

    from rollout import attention

    known = sorted({"eager", attention.NAME, *AttentionInterface().valid_keys()})
    if not isinstance(name, str):
        return f"one of {known}"
    if name.removeprefix("paged|") in known or "/" in name:  # paged|<name>: transformers' deprecated spelling
        return None
    near = closest_key(name, known)
    return f"one of {known} or a Hub kernel 'org/repo'" + (f"; did you mean {near!r}?" if near else "")
