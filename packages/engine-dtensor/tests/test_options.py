"""Engine options and edge cases: bf16, activation checkpointing, CPU offload, uneven DP shards,
non-finite gradients, unsupported TP, the self-started process group, and the flash-attn GPU path."""

from __future__ import annotations

import math
import multiprocessing as mp

import pytest
import torch

from engine_dtensor.engine import DTensorEngine
from engine_dtensor.testing import assert_layout_close, full_grads, grpo_batch, make_policy, max_abs_diff
from rl_core.config import LossConfig
from rl_core.losses import ClippedPGLoss
from rl_core.registry import create_engine
from rl_core.testing.distributed import run_distributed

LOSS = ClippedPGLoss()


def _grads(rank: int, world: int, path: str, batch, overrides: dict) -> tuple:
    engine = DTensorEngine(make_policy(path, **overrides))
    logprobs = engine.compute_logprobs(batch)
    result = engine.forward_backward(batch, LOSS)
    grads = full_grads(engine)
    step = engine.optimizer_step()
    dtypes = {p.dtype for p in engine.model.parameters()}
    recomputed = any("_checkpoint_wrapped_module" in name for name, _ in engine.model.named_parameters())
    names = sorted(name for name, _ in engine.export_hf_weights())
    return logprobs, grads, result.loss, step, dtypes, recomputed, names, _offloaded_units(engine.model)


def _offloaded_units(model: torch.nn.Module) -> list[bool]:
    """Per FSDP unit: does FSDP2 offload its parameters to the host (CPUOffloadPolicy on its param group)?

    On a CPU-only machine offloading changes no number and no device, so the policy FSDP holds is the one
    observable sign that it is configured. (FSDP2 keeps it in private state: `fully_shard` has no getter.)"""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    units = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            units.append(
                isinstance(group.offload_policy, CPUOffloadPolicy)
                and all(p.offload_to_cpu for p in group.fsdp_params)
            )
    return units


def test_activation_checkpointing_and_cpu_offload_change_nothing(ckpt) -> None:
    batch = grpo_batch(ckpt("llama"))
    ref = run_distributed(_grads, 1, args=(ckpt("llama"), batch, {}))[0]
    assert len(ref[7]) == 3 and not any(ref[7])  # FSDP units: the 2 decoder layers and the root
    for cfg in ({"activation_checkpointing": True}, {"cpu_offload": True}):
        got = run_distributed(_grads, 1, args=(ckpt("llama"), batch, {"dtensor_cfg": cfg}))[0]
        assert got[5] == cfg.get("activation_checkpointing", False)  # the layers really are wrapped
        assert got[6] == ref[6]  # exported under HF names all the same
        # every unit, and only under cpu_offload, has FSDP's offload policy
        assert got[7] == [cfg.get("cpu_offload", False)] * len(ref[7])
        lp_diff, grad_diff = assert_layout_close(got[0], ref[0]), assert_layout_close(got[1], ref[1])
        print(f"{cfg}: max|dlogprob| = {lp_diff:.2e}, max|dgrad| = {grad_diff:.2e}")


def test_bfloat16_computes_in_bf16_keeps_fp32_master_weights(ckpt) -> None:
    batch = grpo_batch(ckpt("qwen2"))
    ref = run_distributed(_grads, 1, args=(ckpt("qwen2"), batch, {}))[0]
    got = run_distributed(_grads, 1, args=(ckpt("qwen2"), batch, {"precision": "bfloat16"}))[0]
    lp_diff = max_abs_diff(got[0], ref[0])
    print(f"bf16 vs fp32: max|dlogprob| = {lp_diff:.4f}, loss {got[2]:.5f} vs {ref[2]:.5f}")
    # measured 0.0252 in both venvs (python 3.11 and 3.12, torch 2.13, CPU): the bound leaves a 2x margin
    assert 1e-4 < lp_diff < 0.05  # really computed in bf16, and still close
    assert got[4] == {torch.float32} and math.isfinite(got[3]["grad_norm"]) and got[3]["skipped"] == 0.0


# The per-sequence aggregations divide by the number of sequences in the global batch: a rank that divided
# by its own count (1 here on rank 0, 5 on rank 1) would weigh its sequences 6x and 1.2x too much.
SEQ_MEAN_AGGS = ("seq-mean-token-mean", "seq-mean-token-sum")


def _uneven(rank: int, world: int, path: str, batch) -> tuple:
    """dp=2 with 1 sequence on rank 0 and 5 on rank 1: rank 0 must run dummy micro-batches."""
    engine = DTensorEngine(make_policy(path, train_micro_batch_size=2, logprob_batch_size=2))
    shard = batch.select([0] if rank == 0 else [1, 2, 3, 4, 5]) if world == 2 else batch
    logprobs = engine.compute_logprobs(shard)
    result = engine.forward_backward(shard, LOSS)
    grads = full_grads(engine)
    per_seq = {}
    for agg in SEQ_MEAN_AGGS:
        engine.zero_grad()
        step = engine.forward_backward(shard, ClippedPGLoss(LossConfig(agg=agg)))
        per_seq[agg] = (step.loss, full_grads(engine))
    return logprobs, grads, result.loss, result.num_micro_batches, per_seq


@pytest.mark.distributed
def test_uneven_dp_shards_run_the_same_number_of_micro_batches(ckpt) -> None:
    batch = grpo_batch(ckpt("llama"), lengths=[5, 9, 7, 12, 16, 3])
    ref_lp, ref_grads, ref_loss, _, ref_per_seq = run_distributed(_uneven, 1, args=(ckpt("llama"), batch))[0]
    (lp0, grads, loss, n0, per_seq), (lp1, _, loss1, n1, per_seq1) = run_distributed(
        _uneven, 2, args=(ckpt("llama"), batch)
    )
    assert n0 == n1 == 3 and loss == loss1
    assert abs(loss - ref_loss) <= 1e-6
    assert_layout_close(lp0 + lp1, ref_lp)
    print(f"uneven shards: max|dgrad| = {assert_layout_close(grads, ref_grads):.2e}")
    for agg in SEQ_MEAN_AGGS:  # the sequence count is summed over DP ranks, like the token count
        (agg_loss, agg_grads), (ref_agg_loss, ref_agg_grads) = per_seq[agg], ref_per_seq[agg]
        assert per_seq1[agg][0] == agg_loss and abs(agg_loss - ref_agg_loss) <= 1e-6, agg
        print(f"uneven shards {agg}: |dloss| = {abs(agg_loss - ref_agg_loss):.1e}, "
              f"max|dgrad| = {assert_layout_close(agg_grads, ref_agg_grads):.2e}")


def _nan_step(rank: int, world: int, path: str, batch) -> tuple:
    engine = DTensorEngine(make_policy(path))
    before = dict(engine.export_hf_weights())
    engine.forward_backward(batch, lambda inputs: (inputs.logprobs.sum() * float("nan"), {}))
    step = engine.optimizer_step()
    after = dict(engine.export_hf_weights())
    return step, all(torch.equal(before[k], after[k]) for k in before), engine.scheduler.last_epoch


def test_non_finite_grad_norm_skips_the_step(ckpt) -> None:
    step, unchanged, sched_steps = run_distributed(
        _nan_step, 1, args=(ckpt("llama"), grpo_batch(ckpt("llama")))
    )[0]
    assert step["skipped"] == 1.0 and math.isnan(step["grad_norm"]) and unchanged and sched_steps == 0


def _moe_tp(rank: int, world: int, path: str) -> str:
    try:
        DTensorEngine(make_policy(path, dtensor_cfg={"tensor_parallel_size": 2}))
    except ValueError as exc:
        return str(exc)
    return ""


@pytest.mark.distributed
def test_tensor_parallel_on_moe_is_a_clear_error(ckpt) -> None:
    message = run_distributed(_moe_tp, 2, args=(ckpt("qwen3_moe"),))[0]
    assert "model_type 'qwen3_moe'" in message and "tensor_parallel_size=1" in message


def _no_process_group(path: str, queue) -> None:  # noqa: ANN001
    import torch.distributed as dist

    try:
        engine = create_engine(make_policy(path))  # through the registry, like the trainer
        queue.put(
            (
                type(engine).__name__,
                dist.get_world_size(),
                engine.dp_size,
                len(engine.compute_logprobs(grpo_batch(path))),
            )
        )
    except BaseException as exc:  # noqa: BLE001 - report to the parent
        queue.put(repr(exc))


def test_engine_starts_its_own_process_group(ckpt) -> None:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=_no_process_group, args=(ckpt("llama"), queue))
    proc.start()
    result = queue.get(timeout=120)
    proc.join()
    assert result == ("DTensorEngine", 1, 1, 8)


def _flash_vs_sdpa(rank: int, world: int, path: str, batch) -> list:
    out = []
    for impl, packed in (("flash_attention_2", True), ("flash_attention_2", False), ("sdpa", False)):
        policy = make_policy(
            path,
            precision="bfloat16",  # flash-attn has no fp32 kernels
            sequence_packing={"enabled": packed},
            dtensor_cfg={"attn_implementation": impl},
        )
        engine = DTensorEngine(policy)
        logprobs = engine.compute_logprobs(batch)
        engine.forward_backward(batch, LOSS)
        grads = torch.cat([g.float().flatten().cpu() for g in full_grads(engine).values()])
        out.append((logprobs, grads))
    return out


@pytest.mark.gpu
def test_flash_attention_varlen_packing_on_gpu(ckpt) -> None:
    pytest.importorskip("flash_attn")
    batch = grpo_batch(ckpt("llama"))
    ((packed_lp, packed_g), *others) = run_distributed(_flash_vs_sdpa, 1, args=(ckpt("llama"), batch))[0]
    for lp, grads in others:  # bf16 compute: layouts agree to bf16 rounding, not to fp32 ulps
        assert max_abs_diff(packed_lp, lp) < 0.05
        assert torch.nn.functional.cosine_similarity(packed_g, grads, dim=0) > 0.999


def test_attention_kernel_choice(monkeypatch) -> None:
    import importlib.util

    from engine_dtensor.engine import resolve_attn_implementation

    assert resolve_attn_implementation("auto", torch.device("cpu"), "bfloat16") == "sdpa_segments"
    # with flash-attn installed, on CUDA in bf16, too: sdpa_segments calls flash-attn's varlen kernel itself
    # with lengths computed once per micro-batch (HF's flash_attention_2 re-reads them in every layer)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn"
                        else real_find_spec(name, *a))
    assert resolve_attn_implementation("auto", torch.device("cuda"), "bfloat16") == "sdpa_segments"
    assert resolve_attn_implementation("eager", torch.device("cpu"), "float32") == "eager"
    with pytest.raises(ValueError, match=r"needs CUDA and flash-attn"):
        resolve_attn_implementation("flash_attention_2", torch.device("cpu"), "bfloat16")


def _compiled_steps(rank: int, world: int, path: str, batches: list, compile_layers: bool) -> tuple:
    """Logprobs and grads of each batch (packed, one optimizer step between), and how many graphs dynamo
    compiled during each batch."""
    from torch._dynamo.utils import counters

    engine = DTensorEngine(make_policy(path, sequence_packing={"enabled": True, "train_mb_tokens": 48},
                                       dtensor_cfg={"compile": compile_layers}))
    out, compiled = [], []
    for batch in batches:
        before = counters["stats"]["unique_graphs"]
        logprobs = engine.compute_logprobs(batch)
        engine.forward_backward(batch, LOSS)
        out.append((logprobs, full_grads(engine)))
        engine.optimizer_step()
        compiled.append(counters["stats"]["unique_graphs"] - before)
    return out, compiled


@pytest.mark.slow
def test_compiled_layers_equal_eager_and_new_lengths_compile_nothing_new(ckpt) -> None:
    """policy.dtensor_cfg.compile: each decoder layer through torch.compile with dynamic shapes. Results equal
    the eager engine's, and once the first batch compiled, batches of other lengths (every GRPO step brings
    new ones) reuse the graphs: a recompile per new length would cost its compile time every step."""
    path = ckpt("qwen2")
    batches = [grpo_batch(path, lengths=lengths, seed=i) for i, lengths in
               enumerate([[5, 9, 7, 12, 16, 3], [11, 4, 20, 6, 8], [13, 2, 9, 17, 10, 7, 5]])]
    eager, _ = run_distributed(_compiled_steps, 1, args=(path, batches, False))[0]
    compiled, graphs = run_distributed(_compiled_steps, 1, args=(path, batches, True))[0]
    for (lp, grads), (ref_lp, ref_grads) in zip(compiled, eager):
        # fp32 throughout; fused kernels reorder the arithmetic: a few ulp, not the layouts' 1e-6
        for got, want in [*zip(lp, ref_lp), *((grads[k], ref_grads[k]) for k in ref_grads)]:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        print(f"compiled vs eager: max|dlogprob| = {max_abs_diff(lp, ref_lp):.2e}, "
              f"max|dgrad| = {max_abs_diff(grads, ref_grads):.2e}")
    print(f"graphs compiled per batch: {graphs}")
    assert graphs[0] > 0 and graphs[1:] == [0, 0], graphs


def _gradient_divides(rank: int, world: int, path: str, batch) -> int:
    """Divisions of FSDP's flat gradient buffers (by their size: more elements than any parameter) in one
    forward_backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Divides(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.div, torch.ops.aten.div_) and args[0].numel() > largest:
                self.count += 1
            return out

    engine = DTensorEngine(make_policy(path))
    largest = max(p.numel() for p in engine.model.parameters())
    with Divides() as divides:
        engine.forward_backward(batch, LOSS)
    return divides.count


def test_one_rank_fsdp_does_not_divide_the_gradients(ckpt) -> None:
    """Losses come pre-normalised, so FSDP's divide factor is 1.0 where DP sums over ranks; on one rank
    there is nothing to sum, and setting the factor made FSDP divide every gradient by 1.0 anyway."""
    assert run_distributed(_gradient_divides, 1, args=(ckpt("qwen2"), grpo_batch(ckpt("qwen2"))))[0] == 0
