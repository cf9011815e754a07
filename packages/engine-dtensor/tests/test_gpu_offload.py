"""CUDA only (skipped without a GPU; a spawned rank, never forked after CUDA): the colocated refit's offload.

`offload(keep_weights=True)` frees the optimizer state and keeps the parameters (the export right after it is
unchanged); `offload()` then frees the parameters too; `onload` restores the logprobs bit for bit. On CPU the
moves are no-ops, so only a GPU shows them.
"""

from __future__ import annotations

import pytest
import torch

from rl_core.testing.distributed import CUDA_BACKEND, run_distributed


def _offload(rank: int, world_size: int, path: str) -> dict:
    from engine_dtensor.engine import DTensorEngine
    from engine_dtensor.testing import grpo_batch, make_policy
    from rl_core.losses import ClippedPGLoss
    from rl_core.reference import local_tensor
    from rl_core.testing.contracts import offload_stages

    engine = DTensorEngine(make_policy(path))
    stages = offload_stages(engine, grpo_batch(path), ClippedPGLoss())
    weight_bytes = sum(local_tensor(p).untyped_storage().nbytes() for p in engine.model.parameters())
    state_bytes = sum(v.untyped_storage().nbytes() for s in engine.optimizer.state.values() for k, v in s.items()
                      if torch.is_tensor(v) and k != "step")
    return {**stages, "weight_bytes": weight_bytes, "optimizer_state_bytes": state_bytes}


@pytest.mark.gpu
def test_offload_keeps_weights_for_the_refit_then_frees_them(ckpt) -> None:
    r = run_distributed(_offload, world_size=1, args=(ckpt("qwen2"),), backend=CUDA_BACKEND)[0]
    assert r["export_unchanged"] and r["restored"], r
    assert r["trained"] - r["weights_only"] >= r["optimizer_state_bytes"] > 0, r
    assert r["weights_only"] - r["offloaded"] >= r["weight_bytes"] > 0, r


def _fsdp_cpu_offload(rank: int, world_size: int, path: str, hf_dir: str) -> dict:
    """The same steps with and without FSDP2's CPUOffloadPolicy (`dtensor_cfg.cpu_offload`), on CUDA: host-resident
    shards are all-gathered to the GPU for compute, and export gathers them (over gloo: they live on the host)."""
    from engine_dtensor.engine import DTensorEngine
    from engine_dtensor.testing import grpo_batch, make_policy
    from rl_core.losses import ClippedPGLoss

    batch, out = grpo_batch(path), {}
    for name, cfg in (("plain", {}), ("offload", {"cpu_offload": True})):
        engine = DTensorEngine(make_policy(path, dtensor_cfg=cfg))
        logprobs = engine.compute_logprobs(batch)
        metrics = engine.train_batch(batch, ClippedPGLoss())
        exported = {k: v.detach().cpu().clone() for k, v in engine.export_hf_weights()}
        if name == "offload":
            engine.save_hf(hf_dir)
        out[name] = {"logprobs": [lp.cpu() for lp in logprobs], "loss": metrics["loss"], "weights": exported}
        del engine
    return out


@pytest.mark.gpu
def test_fsdp_cpu_offload_trains_and_exports_as_without_it(ckpt, tmp_path) -> None:
    from safetensors.torch import load_file

    r = run_distributed(_fsdp_cpu_offload, world_size=1, args=(ckpt("qwen2"), str(tmp_path / "hf")),
                        backend=CUDA_BACKEND)[0]
    plain, offload = r["plain"], r["offload"]
    for a, b in zip(plain["logprobs"], offload["logprobs"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert abs(plain["loss"] - offload["loss"]) < 1e-5
    assert plain["weights"].keys() == offload["weights"].keys()
    for name, weight in plain["weights"].items():  # one optimizer step, same math: the same weights
        torch.testing.assert_close(offload["weights"][name], weight, atol=1e-6, rtol=0)
    saved = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert all(torch.equal(saved[name], offload["weights"][name]) for name in saved)
