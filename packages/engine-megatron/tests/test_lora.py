"""LoRA in the Megatron engine (`policy.megatron_cfg.lora_cfg`) against independent computations.

The headline is cross-engine: the DTensor engine's LoRA (its own implementation, one nn.Linear pair per HF module)
and the Megatron engine's (adapters on megatron's fused linear_qkv / linear_fc1, TP and SP through megatron's
mappings) train the same tiny checkpoint with the same lora_cfg for several AdamW steps and agree on losses, grad
norms, logprobs and merged exported weights; that checks the initial A (order and seed), the interleaving into the
fused layouts, the scaling and the TP/SP gradient paths. Then one TP=2 + SP run: the base stays bitwise frozen, the
optimizer holds the adapters alone, at step 0 and as the KL reference the model is the base model, peft's LoRA on
the base HF model computes the merged save_hf copy, and the offline export of the engine checkpoint is the live
save_hf. Resume: test_checkpoint.py's bitwise resume runs a LoRA layout too.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from megatron_testutil import (
    LOSS,
    assert_layout,
    by_index,
    dtensor_run,
    engine_run,
    global_batch,
    hf_target_logprobs,
    make_policy,
    max_abs_diff,
    weight_diffs,
)

from rl_core.config import ConfigError
from rl_core.losses import ClippedPGLoss
from rl_core.testing.distributed import run_distributed

logger = logging.getLogger(__name__)
pytest.importorskip("engine_dtensor")

LORA = {"enabled": True, "dim": 4, "alpha": 8.0}
STEPS = 3
LAYOUTS = {
    "1rank": (1, {}),
    "tp2": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": False}),
    "tp2-sp": (2, {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    "pp2": (2, {"pipeline_model_parallel_size": 2}),  # each stage draws every layer's A: one global order
    "dp2": (2, {}),  # the distributed optimizer shards the adapters' state over DP
}


@pytest.fixture(scope="module")
def dtensor_lora(tiny_ckpt):
    """arch -> the DTensor engine's LoRA run (1 rank, STEPS steps), computed once per module."""
    runs: dict[str, list[dict]] = {}

    def get(arch: str) -> list[dict]:
        if arch not in runs:
            runs[arch] = run_distributed(dtensor_run, world_size=1, args=(tiny_ckpt(arch), {"lora_cfg": LORA}, STEPS))
        return runs[arch]

    return get


@pytest.mark.distributed
@pytest.mark.parametrize(("arch", "layout"), [("qwen2", "1rank"), ("qwen2", "tp2"), ("qwen2", "tp2-sp"),
                                              ("qwen2", "pp2"), ("qwen2", "dp2"), ("llama", "tp2-sp")])
def test_megatron_lora_trains_the_dtensor_engines_adapters(dtensor_lora, tiny_ckpt, arch: str, layout: str) -> None:
    world, parallel = LAYOUTS[layout]
    megatron_cfg = {**parallel, "lora_cfg": LORA}
    megatron = run_distributed(engine_run, world_size=world, args=(tiny_ckpt(arch), megatron_cfg, {}, STEPS))
    assert_layout(megatron, world, megatron_cfg, {})  # TP=2 really ran as TP=2
    dtensor = dtensor_lora(arch)
    steps = list(zip(megatron[0]["metrics"], dtensor[0]["metrics"]))
    rel, absolute = weight_diffs(megatron[0]["weights"], dtensor[0]["weights"])
    diffs = {"logprobs_before": max_abs_diff(by_index(megatron, "before"), by_index(dtensor, "before")),
             "logprobs_after": max_abs_diff(by_index(megatron, "after"), by_index(dtensor, "after")),
             "loss": max(abs(m["loss"] - d["loss"]) for m, d in steps),
             "grad_norm_rel": max(abs(m["grad_norm"] - d["grad_norm"]) / d["grad_norm"] for m, d in steps),
             "weights_rel": rel, "weights_abs": absolute}
    logger.info("LoRA %s megatron %s vs dtensor over %d steps: %s", arch, layout, STEPS, diffs)
    trained = max_abs_diff(by_index(dtensor, "after"), by_index(dtensor, "before"))
    assert trained > 1e-3 and dtensor[0]["metrics"][-1]["loss"] != dtensor[0]["metrics"][0]["loss"]  # it moved
    # measured (CPU, fp32): logprobs <= 1.9e-6 (a few ulps at ~ -5), loss <= 2.1e-7, grad norm <= 4.1e-7 relative,
    # merged weights <= 9.2e-8 relative and 4.8e-7 absolute
    assert diffs["logprobs_before"] <= 5e-6 and diffs["loss"] <= 1e-6 and diffs["grad_norm_rel"] <= 2e-6, diffs
    assert diffs["logprobs_after"] <= 5e-6 and rel <= 1e-6 and absolute <= 2e-6, diffs


def _param_names(engine, adapters: bool) -> dict[str, torch.Tensor]:
    from engine_megatron import lora
    from engine_megatron.model import gpt_model

    return {n: p.detach().clone() for n, p in gpt_model(engine.model).named_parameters()
            if lora.is_adapter(n) == adapters}


def _optimizer_names(engine) -> list[str]:
    """The model parameters megatron's distributed optimizer updates (those of its DDP grad buffers)."""
    from engine_megatron.model import gpt_model

    held = {id(p) for sub in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
            for p in sub.model_param_group_index_map}
    return sorted(n for n, p in gpt_model(engine.model).named_parameters() if id(p) in held)


def _lifecycle(rank: int, world_size: int, ckpt: str, out: str) -> dict:
    """TP=2 + SP: logprobs at step 0, STEPS steps, the reference after them, save_hf and the engine checkpoint."""
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(ckpt, {**LAYOUTS["tp2-sp"][1], "lora_cfg": LORA}))
    batch = global_batch(0)  # DP=1: every rank runs the whole batch
    initial = engine.compute_logprobs(batch)
    engine.snapshot_reference()
    base, adapters = _param_names(engine, adapters=False), _param_names(engine, adapters=True)
    batch = batch.with_fields(prev_logprobs=[lp.clone() for lp in initial])
    for _ in range(STEPS):
        engine.train_batch(batch, ClippedPGLoss(LOSS))
    engine.save_hf(f"{out}/hf")
    engine.save_checkpoint(f"{out}/engine_ckpt")
    return {"initial": initial, "reference": engine.compute_ref_logprobs(batch),
            "trained": engine.compute_logprobs(batch), "base": (base, _param_names(engine, adapters=False)),
            "adapters": (adapters, _param_names(engine, adapters=True)), "optimizer": _optimizer_names(engine)}


@pytest.fixture(scope="module")
def lifecycle(tiny_ckpt, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("lora")
    ckpt = tiny_ckpt("qwen2")
    return {"ranks": run_distributed(_lifecycle, world_size=2, args=(ckpt, str(out))), "out": out, "ckpt": ckpt}


@pytest.mark.distributed
def test_base_is_frozen_and_the_optimizer_holds_the_adapters_only(lifecycle) -> None:
    for rank in lifecycle["ranks"]:
        (base_before, base_after), (adapters_before, adapters_after) = rank["base"], rank["adapters"]
        assert base_before.keys() == base_after.keys() and len(base_before) > 0
        assert [n for n in base_before if not torch.equal(base_before[n], base_after[n])] == []  # bitwise
        # 7 HF modules x 2 layers, A and B each; embeddings, norms and output layer frozen too
        assert rank["optimizer"] == sorted(adapters_before) and len(adapters_before) == 2 * 14
        assert all(torch.count_nonzero(t) == 0 for n, t in adapters_before.items() if n.endswith("lora_B"))
        assert [n for n in adapters_before if torch.equal(adapters_before[n], adapters_after[n])] == []


@pytest.mark.distributed
def test_step_zero_and_the_reference_are_the_base_model(lifecycle) -> None:
    rank0 = lifecycle["ranks"][0]
    hf = hf_target_logprobs(lifecycle["ckpt"], global_batch(0))  # the base model, loaded by transformers
    assert max_abs_diff(dict(enumerate(rank0["initial"])), dict(enumerate(hf))) <= 5e-6
    # adapters off (the KL reference) after training: exactly the step-0 computation (B = 0 adds exact zeros)
    assert all(torch.equal(a, b) for a, b in zip(rank0["reference"], rank0["initial"]))
    assert max_abs_diff(dict(enumerate(rank0["trained"])), dict(enumerate(rank0["initial"]))) > 1e-3


def _read(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: t for file in sorted(directory.glob("*.safetensors")) for name, t in load_file(str(file)).items()}


@pytest.mark.distributed
def test_peft_adapter_on_the_base_model_is_the_merged_copy(lifecycle) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf_dir = lifecycle["out"] / "hf"
    adapter = _read(hf_dir / "adapter")
    assert len(adapter) == 28 and all(k.startswith("base_model.model.model.layers.") for k in adapter)
    config = json.loads((hf_dir / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        4, 8.0, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"])
    merged_weights, base_weights = _read(hf_dir), _read(Path(lifecycle["ckpt"]))
    for key, a in adapter.items():  # the merged copy is W + alpha/dim * B @ A in float64, to float32 rounding
        if ".lora_A." in key:
            module = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            b = adapter[key.replace(".lora_A.", ".lora_B.")]
            expected = base_weights[f"{module}.weight"].double() + 2.0 * (b.double() @ a.double())
            assert float((merged_weights[f"{module}.weight"].double() - expected).abs().max()) <= 1e-6, module
    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(lifecycle["ckpt"], dtype=torch.float32), str(hf_dir / "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ids = [seq[None] for seq in global_batch(0).input_ids]
        adapted = {i: peft_model(input_ids=x).logits for i, x in enumerate(ids)}
        reference = {i: merged(input_ids=x).logits for i, x in enumerate(ids)}
        with peft_model.disable_adapter():
            base = {i: peft_model(input_ids=x).logits for i, x in enumerate(ids)}
    diff = max_abs_diff(adapted, reference)
    logger.info("peft (base + adapter) vs the merged save_hf copy: max|dlogit| = %.1e", diff)
    assert diff <= 1e-5 and max_abs_diff(adapted, base) > 1e-3


@pytest.mark.distributed
def test_offline_export_of_the_checkpoint_is_the_live_save_hf(lifecycle, tmp_path: Path) -> None:
    from engine_megatron.engine import MegatronEngine

    live = lifecycle["out"] / "hf"
    MegatronEngine.checkpoint_to_hf(str(lifecycle["out"] / "engine_ckpt"), str(tmp_path / "hf"),
                                   model_dir=lifecycle["ckpt"])
    offline, expected = _read(tmp_path / "hf"), _read(live)
    assert offline.keys() == expected.keys() and all(torch.equal(offline[n], expected[n]) for n in expected)
    offline_adapter, live_adapter = _read(tmp_path / "hf" / "adapter"), _read(live / "adapter")
    assert offline_adapter.keys() == live_adapter.keys()
    assert all(torch.equal(offline_adapter[n], live_adapter[n]) for n in live_adapter)
    assert ((tmp_path / "hf/adapter/adapter_config.json").read_text()
            == (live / "adapter/adapter_config.json").read_text())


def _checkpoint_tensors(path: Path) -> list[str]:
    """The keys of the tensors a dist_checkpointing (torch_dist) directory holds, model and optimizer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return sorted(key for key, meta in entries.items() if isinstance(meta, TensorStorageMetadata))


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.distributed
def test_checkpoint_holds_the_adapters_alone_and_records_the_base(lifecycle) -> None:
    """No frozen base tensor in the engine checkpoint: the adapters and their (distributed) optimizer state only, a
    fraction of the base model's size; ckpt_convert.json names the base directory and its fingerprint."""
    from rl_core.lora import BaseModel

    ckpt = lifecycle["out"] / "engine_ckpt"
    keys = _checkpoint_tensors(ckpt)
    adapters = [k for k in keys if not k.startswith("optimizer.")]
    assert adapters and all(k.endswith((".lora_A", ".lora_B")) for k in keys), keys
    assert len(adapters) == 2 * 7  # A and B of q, k, v, o, gate, up, down, layers stacked in one tensor each
    saved = json.loads((ckpt / "ckpt_convert.json").read_text())["lora"]
    assert BaseModel.from_dict(saved["base_model"]) == BaseModel.of(lifecycle["ckpt"])
    weights = sum(f.stat().st_size for f in Path(lifecycle["ckpt"]).glob("*.safetensors"))
    logger.info("LoRA engine checkpoint %d bytes, base model weights %d bytes", _dir_bytes(ckpt), weights)
    # the tiny model's adapters (dim 4) are 5% of its parameters, stored with their float32 main copy and Adam's two
    # moments; a checkpoint with the frozen base held the base's bytes on top of them
    assert _dir_bytes(ckpt) < weights


def _load_onto(rank: int, world_size: int, base: str, ckpt: str) -> str:
    from engine_megatron.engine import MegatronEngine

    engine = MegatronEngine(make_policy(base, {"lora_cfg": LORA}))
    try:
        engine.load_checkpoint(ckpt)
    except ValueError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.distributed
def test_resume_onto_another_base_model_is_refused(lifecycle, tmp_path: Path) -> None:
    """The same shapes with other weights: the adapters would load, onto a model they were not trained on."""
    from megatron_testutil import VOCAB

    from rl_core.testing.tiny_models import save_tiny_checkpoint

    other = str(save_tiny_checkpoint(tmp_path / "other", "qwen2", seed=0, vocab_size=VOCAB))
    ckpt = lifecycle["out"] / "engine_ckpt"
    (message,) = run_distributed(_load_onto, world_size=1, args=(other, str(ckpt)))
    assert message.startswith(f"LoRA checkpoint {ckpt} was trained on the base model at {lifecycle['ckpt']} ")
    assert f"the base directory this run uses, {other}, holds another model" in message
    assert message.endswith("point policy.model_name at the base the run was trained from")
    assert run_distributed(_load_onto, world_size=1, args=(lifecycle["ckpt"], str(ckpt))) == ["loaded"]


@pytest.mark.distributed
def test_mcore2hf_reads_the_recorded_base_or_names_the_option(lifecycle, tmp_path: Path, capsys) -> None:
    """`ckpt-convert mcore2hf` of the adapter-only checkpoint: by default the base directory it records (the live
    save_hf's weights again); a base directory that is gone, or holds another model, is refused naming the fix."""
    from ckpt_convert.cli import main

    ckpt = str(lifecycle["out"] / "engine_ckpt")
    assert main(["mcore2hf", "--mcore", ckpt, "--out", str(tmp_path / "hf")]) == 0
    offline, live = _read(tmp_path / "hf"), _read(lifecycle["out"] / "hf")
    assert offline.keys() == live.keys() and all(torch.equal(offline[n], live[n]) for n in live)

    gone = tmp_path / "moved"
    assert main(["mcore2hf", "--mcore", ckpt, "--out", str(tmp_path / "out"), "--base-model", str(gone)]) == 2
    assert (f"the base model directory {gone} of LoRA checkpoint {ckpt} does not exist (the checkpoint holds the "
            "adapters only): pass the directory of that base with --base-model DIR") in capsys.readouterr().err
    other = tmp_path / "other"
    shutil.copytree(lifecycle["ckpt"], other)
    weights = bytearray((other / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF  # the same shapes, one weight byte changed
    (other / "model.safetensors").write_bytes(bytes(weights))
    assert main(["mcore2hf", "--mcore", ckpt, "--out", str(tmp_path / "out"), "--base-model", str(other)]) == 2
    assert "point --base-model DIR" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def _no_weights(tiny_ckpt, arch: str, tmp_path: Path) -> str:
    """A directory with the checkpoint's config.json only: what check_model reads."""
    shutil.copy(Path(tiny_ckpt(arch)) / "config.json", tmp_path)
    return str(tmp_path)


@pytest.mark.parametrize(("lora", "message"), [
    ({"target_modules": ["q_proj", "qproj"]},
     r"policy\.megatron_cfg\.lora_cfg\.target_modules: \['qproj'\] match no nn\.Linear .*'q_proj'"),
    ({"exclude_modules": ["gate"]}, r"policy\.megatron_cfg\.lora_cfg\.exclude_modules: \['gate'\] match no"),
    ({"exclude_modules": ["*"]}, r"exclude_modules excludes every target module"),
])
def test_targets_that_match_nothing_name_the_valid_ones(tiny_ckpt, tmp_path: Path, lora: dict, message: str) -> None:
    from engine_megatron.engine import MegatronEngine

    policy = make_policy(_no_weights(tiny_ckpt, "qwen2", tmp_path), {"lora_cfg": {**LORA, **lora}})
    with pytest.raises(ConfigError, match=message):
        MegatronEngine.check_model(policy)


def test_targets_select_the_dtensor_engines_modules(tiny_ckpt) -> None:
    """The same patterns select the same HF modules in both engines (leaf names, globs on full names, excludes)."""
    from ckpt_convert.mcore_model import load_hf_config, mcore_model_config
    from engine_dtensor.config import LoRAConfig as DTensorLoRAConfig
    from engine_dtensor.loading import build_meta_model
    from engine_dtensor.lora import select_targets as dtensor_targets
    from engine_megatron import lora
    from engine_megatron.config import LoRAConfig

    ckpt = tiny_ckpt("qwen2")
    model_cfg = mcore_model_config(load_hf_config(ckpt))
    for patterns in ({}, {"target_modules": ["*.self_attn.*", "up_proj"], "exclude_modules": ["o_proj"]},
                     {"target_modules": ["q_proj", "down_proj"], "exclude_modules": ["model.layers.0.*"]}):
        megatron = lora.select_targets(model_cfg, LoRAConfig(enabled=True, **patterns))
        dtensor = dtensor_targets(build_meta_model(ckpt, "sdpa"), DTensorLoRAConfig(enabled=True, **patterns))
        assert megatron == dtensor, patterns


def test_lora_on_a_model_with_experts_is_refused(tiny_ckpt, tmp_path: Path) -> None:
    from engine_megatron.engine import MegatronEngine

    policy = make_policy(_no_weights(tiny_ckpt, "qwen3_moe", tmp_path), {"lora_cfg": LORA})
    with pytest.raises(ConfigError, match=r"policy\.megatron_cfg\.lora_cfg\.enabled=true: .*mixture-of-experts"):
        MegatronEngine.check_model(policy)
