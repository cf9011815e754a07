"""Parallel layouts change no result: FSDP2 over 2 ranks and TP=2 (with and without SP) vs 1 rank."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import DTensor

from engine_dtensor.engine import DTensorEngine
from engine_dtensor.forward import build_padded_inputs, forward_logprobs
from engine_dtensor.testing import assert_layout_close, full_grads, grpo_batch, make_policy, max_abs_diff
from rl_core.losses import ClippedPGLoss
from rl_core.testing.distributed import run_distributed

pytestmark = pytest.mark.distributed


# Adam's first updates are ~lr * g / (|g| + eps): for elements whose |g| is near eps, fp32 rounding of
# the gradient moves the update by a visible fraction of lr (1.4e-5 at lr 1e-3 for 1e-10 grad noise).
# The gradients themselves are compared at 1e-6; the parameters at lr 1e-4 and 1e-5.
ADAMW = {"name": "AdamW", "kwargs": {"lr": 1e-4, "weight_decay": 0.01}}


def _train_steps(
    rank: int, world: int, path: str, batch, steps: int
) -> tuple[list[float], dict, dict | None]:
    """`steps` GRPO updates on this rank's share of `batch`: losses, first grads, (rank 0) full params."""
    engine = DTensorEngine(make_policy(path, train_micro_batch_size=2, optimizer=ADAMW))
    shard = batch.select(list(range(rank, len(batch), world)))  # uneven lengths per rank on purpose
    losses = [engine.forward_backward(shard, ClippedPGLoss()).loss]
    grads = full_grads(engine)
    engine.optimizer_step()
    losses += [engine.train_batch(shard, ClippedPGLoss())["loss"] for _ in range(steps - 1)]
    params = dict(engine.export_hf_weights())
    return losses, grads, params if rank == 0 else None


def test_fsdp_two_ranks_equal_one_rank(ckpt) -> None:
    batch = grpo_batch(ckpt("llama"))
    ((ref_losses, ref_grads, ref_params),) = run_distributed(_train_steps, 1, args=(ckpt("llama"), batch, 3))
    results = run_distributed(_train_steps, 2, args=(ckpt("llama"), batch, 3))
    losses, grads, params = results[0]
    assert results[1][0] == losses  # StepResult.loss is the global loss on every rank
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    grad_diff, param_diff = max_abs_diff(grads, ref_grads), max_abs_diff(params, ref_params)
    print(
        f"FSDP2 dp=2 vs 1 rank: max|dgrad| step 1 = {grad_diff:.2e}; after 3 AdamW steps "
        f"max|dloss| = {loss_diff:.2e}, max|dparam| = {param_diff:.2e}"
    )
    assert grad_diff <= 1e-6 and loss_diff <= 1e-5 and param_diff <= 1e-5
    assert max_abs_diff(params, _initial_params(ckpt("llama"))) > 1e-4  # the steps did move the weights


def _initial_params(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict())


def _tp_run(rank: int, world: int, path: str, batch, sequence_parallel: bool, packing: bool = False) -> dict:
    cfg = {"tensor_parallel_size": world, "sequence_parallel": sequence_parallel} if world > 1 else {}
    engine = DTensorEngine(
        make_policy(
            path,
            train_micro_batch_size=4,
            logprob_batch_size=4,
            dtensor_cfg=cfg,
            sequence_packing={"enabled": packing, "train_mb_tokens": 40, "logprob_mb_tokens": 40},
        )
    )
    out = {"logprobs": engine.compute_logprobs(batch)}
    engine.forward_backward(batch, ClippedPGLoss())
    out["grads"] = full_grads(engine)
    out["grad_norm"] = engine.optimizer_step()["grad_norm"]  # clipping groups grads by mesh under TP
    if world > 1:  # vocab-parallel logprobs vs log_softmax of the gathered [tokens, vocab] logits
        inputs = build_padded_inputs(
            batch.input_ids[:4], attn_impl="sdpa", seq_multiple=world, device=engine.device
        )
        # sequence parallel: every RMSNorm (per layer and final) works on this rank's half of the sequence
        norm_lengths: list[int] = []
        hooks = [
            module.register_forward_hook(lambda mod, args, output: norm_lengths.append(output.shape[1]))
            for name, module in engine.model.named_modules()
            if name.endswith(("input_layernorm", "post_attention_layernorm")) or name == "model.norm"
        ]
        with torch.no_grad():
            lp, _ = forward_logprobs(engine.model, inputs, temperature=1.0, with_entropy=False)
            logits = engine.model(
                input_ids=inputs.input_ids,
                attention_mask=inputs.attention_mask,
                position_ids=inputs.position_ids,
            ).logits
            out["sharded_logits"] = (
                isinstance(logits, DTensor) and logits.to_local().shape[-1] < logits.shape[-1]
            )
            full = torch.log_softmax(logits.full_tensor().float(), -1)
            gathered = full[:, :-1].gather(-1, inputs.input_ids[:, 1:, None])[..., 0]
            out["vocab_parallel"] = [lp[:, 1:]]
            out["gathered"] = [gathered]
        for hook in hooks:
            hook.remove()
        out["norm_seq_fraction"] = (len(hooks), {n / inputs.input_ids.shape[1] for n in norm_lengths})
    return out


@pytest.mark.parametrize(
    ("arch", "sequence_parallel", "packing"),
    [("llama", False, False), ("qwen3", True, False), ("qwen2", True, True), ("mistral", False, True)],
)
def test_tensor_parallel_equals_one_rank(ckpt, arch: str, sequence_parallel: bool, packing: bool) -> None:
    batch = grpo_batch(ckpt(arch), lengths=[5, 9, 7, 12, 16, 3])
    (ref,) = run_distributed(_tp_run, 1, args=(ckpt(arch), batch, False))
    tp, _ = run_distributed(_tp_run, 2, args=(ckpt(arch), batch, sequence_parallel, packing))
    lp_diff = assert_layout_close(tp["logprobs"], ref["logprobs"])
    grad_diff = assert_layout_close(tp["grads"], ref["grads"])
    vocab_diff = assert_layout_close(tp["vocab_parallel"], tp["gathered"])
    print(
        f"{arch} TP=2 sp={sequence_parallel} packing={packing}: max|dlogprob| = {lp_diff:.2e}, max|dgrad| = {grad_diff:.2e}, "
        f"vocab-parallel vs gathered = {vocab_diff:.2e}"
    )
    ref_norm = sum(float(g.double().square().sum()) for g in ref["grads"].values()) ** 0.5
    assert tp["grad_norm"] == pytest.approx(ref_norm, rel=1e-6)
    assert ref["grad_norm"] == pytest.approx(ref_norm, rel=1e-6)
    assert tp["sharded_logits"]  # each rank really held a vocab slice of the logits
    # with SP each norm saw a Shard(1) slice of the sequence (half of it); without, the whole sequence
    assert tp["norm_seq_fraction"] == (5, {0.5 if sequence_parallel else 1.0})  # 2 norms x 2 layers + final


def _two_d(rank: int, world: int, path: str, batch) -> tuple:
    """dp x tp = 2 x 2 when world is 4: each DP group takes its half of the batch."""
    tp = 2 if world == 4 else 1
    engine = DTensorEngine(
        make_policy(path, train_micro_batch_size=2, dtensor_cfg={"tensor_parallel_size": tp})
    )
    shard = batch.select(list(range(engine.dp_rank, len(batch), engine.dp_size)))
    logprobs = engine.compute_logprobs(batch)
    loss = engine.forward_backward(shard, ClippedPGLoss()).loss
    grads = full_grads(engine)
    return loss, grads, engine.optimizer_step()["grad_norm"], logprobs


@pytest.mark.slow
def test_fsdp_times_tp_on_four_ranks_equals_one_rank(ckpt) -> None:
    batch = grpo_batch(ckpt("qwen3"), lengths=[5, 9, 7, 12, 16, 3])
    ref_loss, ref_grads, ref_norm, ref_lp = run_distributed(_two_d, 1, args=(ckpt("qwen3"), batch))[0]
    loss, grads, norm, logprobs = run_distributed(_two_d, 4, args=(ckpt("qwen3"), batch))[0]
    grad_diff = assert_layout_close(grads, ref_grads)
    lp_diff = assert_layout_close(logprobs, ref_lp)
    print(
        f"dp=2 x tp=2: max|dgrad| = {grad_diff:.2e}, max|dlogprob| = {lp_diff:.2e}, |dloss| = {abs(loss - ref_loss):.1e}"
    )
    assert loss == pytest.approx(ref_loss, abs=1e-6) and norm == pytest.approx(ref_norm, rel=1e-6)
