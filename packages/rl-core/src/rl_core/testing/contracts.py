"""The contract every `TrainingEngine` and `GenerationBackend` must meet, as reusable checks.

Each engine / backend package calls these from its own tests with its implementation. Independent
references (HF forward passes, float64 math) live in the packages' tests; these checks pin the
behaviour of the interface itself.
"""

from __future__ import annotations

import math
import shutil
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist

from rl_core.batch import LossFn, TokenBatch
from rl_core.interfaces import GenerationBackend, SamplingParams, TrainingEngine
from rl_core.losses import ClippedPGLoss


def random_token_batch(vocab_size: int, lengths: list[int], *, prompt_len: int = 3, seed: int = 0) -> TokenBatch:
    """A GRPO-shaped batch: prompt tokens unmasked, response masked in, random advantages."""
    gen = torch.Generator().manual_seed(seed)
    input_ids = [torch.randint(3, vocab_size, (n,), generator=gen) for n in lengths]
    loss_mask = []
    for n in lengths:
        mask = torch.zeros(n)
        mask[min(prompt_len, n - 1):] = 1.0
        loss_mask.append(mask)
    advantages = [torch.full((n,), float(torch.randn((), generator=gen))) for n in lengths]
    return TokenBatch(input_ids=input_ids, loss_mask=loss_mask, advantages=advantages)


def shared_temp_dir() -> str:
    """A fresh temporary directory, the same path on every rank (checkpoints need one path)."""
    path = [tempfile.mkdtemp(prefix="contract-ckpt-") if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(path, src=0)
    return path[0]


def check_training_engine(make_engine: Callable[[], TrainingEngine], vocab_size: int,
                          checkpoint_dir: str | None = None, lr_at: Callable[[int], float] | None = None) -> None:
    """Shapes, determinism, training moves logprobs, forward_only leaves weights alone, checkpoints restore
    in the same process (weights, optimizer, lr schedule: give `make_engine` a warmup so the lr moves),
    optimizer_step consumes the gradients and reports its grad norm and lr, save_hf writes a model transformers
    loads.

    `lr_at(k)`: the lr the engine's config sets for optimizer step k (0-based), e.g.
    `lambda k: lr * policy.scheduler.lr_factor(k)`; the lr each step reports must equal it (an engine that ignores
    `policy.scheduler` fails here). Under torch.distributed every rank calls this; `checkpoint_dir` (default: a
    shared temp dir) must be the same path on all ranks.
    """
    engine = make_engine()
    assert isinstance(engine, TrainingEngine), f"{type(engine).__name__} does not implement TrainingEngine"
    batch = random_token_batch(vocab_size, [5, 9, 7, 12])
    logprobs = engine.compute_logprobs(batch)
    assert [lp.shape for lp in logprobs] == [torch.Size([n]) for n in batch.lengths]
    for lp in logprobs:
        assert float(lp[0]) == 0.0 and bool((lp[1:] <= 0).all()) and bool(torch.isfinite(lp).all())
    again = engine.compute_logprobs(batch)
    assert all(torch.equal(a, b) for a, b in zip(logprobs, again)), "compute_logprobs is not deterministic"

    batch = batch.with_fields(prev_logprobs=[lp.detach().cpu() for lp in logprobs])
    loss_fn = ClippedPGLoss()
    result = engine.forward_backward(batch, loss_fn, forward_only=True)
    assert math.isfinite(result.loss) and result.num_micro_batches >= 1
    unchanged = engine.compute_logprobs(batch)
    assert all(torch.equal(a, b) for a, b in zip(logprobs, unchanged)), "forward_only changed the model"

    ckpt = checkpoint_dir or shared_temp_dir()
    try:
        engine.save_checkpoint(ckpt + "/step")
        metrics = engine.train_batch(batch, loss_fn)
        for key in ("loss", "grad_norm", "lr"):
            assert key in metrics and math.isfinite(metrics[key]), f"train_batch metrics lack a finite {key!r}"
        trained = engine.compute_logprobs(batch)
        assert any(not torch.equal(a, b) for a, b in zip(logprobs, trained)), "train_batch changed nothing"
        engine.load_checkpoint(ckpt + "/step")  # in the same process: nothing of the trained state may stay
        restored = engine.compute_logprobs(batch)
        assert all(torch.equal(a, b) for a, b in zip(logprobs, restored)), "load_checkpoint did not restore"
        resumed = engine.train_batch(batch, loss_fn)
        assert resumed["lr"] == metrics["lr"], f"lr schedule not restored: {resumed['lr']} != {metrics['lr']}"
        retrained = engine.compute_logprobs(batch)
        assert all(torch.equal(a, b) for a, b in zip(trained, retrained)), "resumed step differs"
        # optimizer_step consumes the gradients: forward_backward + optimizer_step twice == train_batch twice
        lrs = [resumed["lr"]]
        for _ in range(2):
            engine.forward_backward(batch, loss_fn)
            step = engine.optimizer_step()
            for key in ("grad_norm", "lr"):
                assert key in step and math.isfinite(step[key]), f"optimizer_step metrics lack a finite {key!r}"
            lrs.append(step["lr"])
        stepped = engine.compute_logprobs(batch)
        engine.load_checkpoint(ckpt + "/step")
        relrs = [engine.train_batch(batch, loss_fn)["lr"] for _ in range(3)]
        assert relrs == lrs, f"lr of optimizer steps 0-2 after a restore {relrs} != before {lrs}"
        if lr_at is not None:
            expected = [lr_at(k) for k in range(3)]
            assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(lrs, expected)), f"lr of optimizer steps 0-2 {lrs} != the configured {expected}"
        retrained = engine.compute_logprobs(batch)
        assert all(torch.equal(a, b) for a, b in zip(stepped, retrained)), "optimizer_step left gradients behind"
    finally:
        if dist.is_initialized():
            dist.barrier()
        if checkpoint_dir is None and (not dist.is_initialized() or dist.get_rank() == 0):
            shutil.rmtree(ckpt, ignore_errors=True)

    exported = {name: tensor.clone() for name, tensor in engine.export_hf_weights()}
    assert exported and len(exported) == sum(1 for _ in engine.export_hf_weights()), \
        "export_hf_weights yields no or duplicate names"
    check_save_hf(engine, batch.input_ids, retrained)
    engine.offload(keep_weights=True)  # the refit's state: the weights still export
    assert all(torch.equal(tensor, exported[name]) for name, tensor in engine.export_hf_weights())
    engine.offload()
    engine.onload()
    assert all(torch.equal(a, b) for a, b in zip(retrained, engine.compute_logprobs(batch)))


def check_save_hf(engine: TrainingEngine, input_ids: list[torch.Tensor], logprobs: list[torch.Tensor],
                  tol: float = 1e-4) -> None:
    """`save_hf` writes a directory that transformers loads into the engine's model: the loaded model's
    logprobs (fp64 log-softmax, one sequence at a time) match the engine's `logprobs` of `input_ids`."""
    from transformers import AutoModelForCausalLM

    hf_dir = shared_temp_dir()
    try:
        engine.save_hf(hf_dir + "/hf")
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        model = AutoModelForCausalLM.from_pretrained(hf_dir + "/hf", dtype=torch.float32).eval()
        with torch.no_grad():
            for ids, lp in zip(input_ids, logprobs):
                logits = model(input_ids=ids[None]).logits[0].double()  # (L, V)
                ref = torch.log_softmax(logits[:-1], -1).gather(-1, ids[1:, None])[:, 0]
                diff = float((lp[1:].double() - ref).abs().max())
                assert diff <= tol, f"save_hf's model differs from the engine: logprob diff {diff:.2e} > {tol}"
    finally:
        if dist.is_initialized():
            dist.barrier()
        if not dist.is_initialized() or dist.get_rank() == 0:
            shutil.rmtree(hf_dir, ignore_errors=True)


def check_generation_backend(backend: GenerationBackend, prompts: list[list[int]], eos_token_id: int) -> None:
    """Prompt-major n samples, logprob per token, length limits, seeded determinism, sleep/wake."""
    assert isinstance(backend, GenerationBackend), f"{type(backend).__name__} does not implement GenerationBackend"
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=1234)
    out = backend.generate(prompts, params)
    assert [c.prompt_index for c in out] == [i for i in range(len(prompts)) for _ in range(3)]
    for c in out:
        assert 1 <= len(c.token_ids) <= 6 and len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 0 and math.isfinite(lp) for lp in c.logprobs)
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "length":
            assert len(c.token_ids) == 6, "finish_reason 'length' before max_new_tokens"
        else:
            assert c.token_ids[-1] == eos_token_id, "finish_reason 'stop' without the stop token"
    again = backend.generate(prompts, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in again], "a fixed seed must repeat the samples"
    backend.sleep()
    backend.wake()
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    assert [c.token_ids for c in backend.generate(prompts, greedy)] == [
        c.token_ids for c in backend.generate(prompts, greedy)
    ]


def offload_stages(engine: TrainingEngine, batch: TokenBatch, loss_fn: LossFn) -> dict[str, object]:
    """CUDA bytes allocated at each stage of a colocated refit, after a training step (the Adam moments
    exist): `trained`, `weights_only` (offload(keep_weights=True)), `offloaded` (then offload()); whether
    the export at `weights_only` equals the one before, and whether onload restores the logprobs bit for
    bit. Engines' GPU tests compare the drops with the bytes they know they hold."""
    engine.train_batch(batch, loss_fn)
    logprobs = engine.compute_logprobs(batch)
    exported = {name: tensor.to("cpu", copy=True) for name, tensor in engine.export_hf_weights()}
    torch.cuda.synchronize()
    out: dict[str, object] = {"trained": torch.cuda.memory_allocated()}
    engine.offload(keep_weights=True)
    out["weights_only"] = torch.cuda.memory_allocated()
    out["export_unchanged"] = all(torch.equal(t.cpu(), exported[n]) for n, t in engine.export_hf_weights())
    engine.offload()
    out["offloaded"] = torch.cuda.memory_allocated()
    engine.onload()
    out["restored"] = all(torch.equal(a, b) for a, b in zip(logprobs, engine.compute_logprobs(batch)))
    return out
