"""LoRA (`policy.dtensor_cfg.lora_cfg`) against independent computations: at initialisation the model is the
base model; training moves the adapters only; the export is the float64 merge W + alpha/dim * B @ A that plain
transformers loads, and the PEFT-format adapter that peft loads onto the base model computes it; the KL reference is
the base model; FSDP2 over 2 ranks, TP=2 (with and without SP) and a resume change nothing."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine_dtensor.config import DTensorConfig, LoRAConfig
from engine_dtensor.engine import DTensorEngine
from engine_dtensor.loading import build_meta_model
from engine_dtensor.lora import LoRALinear, apply_lora, full_tensor, peft_adapter_config
from engine_dtensor.parallelize import hf_name
from engine_dtensor.testing import (
    assert_layout_close,
    full_grads,
    grpo_batch,
    hf_reference_logprobs,
    make_policy,
    max_abs_diff,
)
from rl_core.config import ConfigError, PolicyConfig
from rl_core.losses import ClippedPGLoss
from rl_core.reference import local_tensor
from rl_core.testing.distributed import CUDA_BACKEND, run_distributed

ARCH = "qwen2"  # q/k/v projections with biases: the base layer's bias must stay
LORA = {"enabled": True, "dim": 4, "alpha": 8.0}


def _policy(path: str, lora: dict | None = None, **overrides) -> PolicyConfig:
    return make_policy(path, train_micro_batch_size=2, dtensor_cfg={"lora_cfg": lora or LORA}, **overrides)


def _local(engine: DTensorEngine, *, adapters: bool) -> dict[str, torch.Tensor]:
    """Copies of this rank's shards of the adapter (or the base) parameters, by module name (FSDP2 leaves the
    root module's parameters unsharded after a forward: local_tensor takes them as they are)."""
    return {name: local_tensor(p).detach().cpu().clone() for name, p in engine.model.named_parameters()
            if (".lora_" in name) == adapters}


def _adapters(engine: DTensorEngine) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """HF weight name -> the module's own full (W, A, B, scaling), read from its parameters."""
    out = {}
    for name, module in engine.model.named_modules():
        if isinstance(module, LoRALinear):
            w, a, b = (full_tensor(p).cpu().clone() for p in
                       (module.base_layer.weight, module.lora_A.weight, module.lora_B.weight))
            out[hf_name(f"{name}.base_layer.weight")] = (w, a, b, module.scaling)
    return out


def _train_and_export(rank: int, world: int, path: str, batch, hf_dir: str) -> dict:
    base_lp = DTensorEngine(make_policy(path, train_micro_batch_size=2)).compute_logprobs(batch)
    engine = DTensorEngine(_policy(path))
    init_lp = engine.compute_logprobs(batch)
    base_before, adapters_before = _local(engine, adapters=False), _local(engine, adapters=True)
    for _ in range(3):
        engine.train_batch(batch, ClippedPGLoss())
    engine.snapshot_reference()  # after training: a copy of the weights would be the trained policy, not the base
    in_optimizer = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    engine.save_hf(hf_dir)
    return {
        "base_lp": base_lp, "init_lp": init_lp,
        "base_before": base_before, "base_after": _local(engine, adapters=False),
        "adapters_before": adapters_before, "adapters_after": _local(engine, adapters=True),
        "optimizer_names": sorted(name for name, p in engine.model.named_parameters() if id(p) in in_optimizer),
        "state_names": sorted(name for name, p in engine.model.named_parameters() if p in engine.optimizer.state),
        "trained_lp": engine.compute_logprobs(batch), "ref_lp": engine.compute_ref_logprobs(batch),
        "export": {name: t.cpu() for name, t in engine.export_hf_weights()}, "adapters": _adapters(engine),
    }


# CPU (gloo, forked rank) and CUDA (a spawned rank; FSDP2 then all-gathers the bf16-cast adapters with the frozen
# weights of their unit on the GPU: run where a GPU is, skipped elsewhere)
BACKENDS = ["gloo", pytest.param(CUDA_BACKEND, marks=pytest.mark.gpu, id="cuda")]


@pytest.fixture(scope="module", params=BACKENDS)
def trained(request, ckpt, tmp_path_factory) -> dict:
    """One LoRA run of 3 steps (1 rank), with what every test below compares."""
    path, hf_dir = ckpt(ARCH), str(tmp_path_factory.mktemp("lora") / "hf")
    batch = grpo_batch(path)
    (result,) = run_distributed(_train_and_export, 1, args=(path, batch, hf_dir), backend=request.param)
    return {**result, "path": path, "batch": batch, "hf_dir": hf_dir}


def test_initial_model_is_the_base_model(trained) -> None:
    # B = 0: the adapter adds exact zeros, so the same engine without LoRA gives the same bits
    assert all(torch.equal(a, b) for a, b in zip(trained["init_lp"], trained["base_lp"]))
    hf = hf_reference_logprobs(trained["path"], trained["batch"].input_ids)  # an HF model loaded separately
    print(f"LoRA at init vs HF: max|dlogprob| = {assert_layout_close(trained['init_lp'], hf):.1e}")
    assert all(torch.count_nonzero(t) == 0 for name, t in trained["adapters_before"].items() if ".lora_B." in name)
    assert all(torch.count_nonzero(t) > 0 for name, t in trained["adapters_before"].items() if ".lora_A." in name)


def test_training_moves_the_adapters_only(trained) -> None:
    base_before, base_after = trained["base_before"], trained["base_after"]
    assert base_before.keys() == base_after.keys() and len(base_before) > 0
    assert [n for n in base_before if not torch.equal(base_before[n], base_after[n])] == []  # bitwise frozen
    # embeddings, norms and lm_head are frozen too: the optimizer holds exactly the adapters
    adapters = sorted(trained["adapters_before"])
    assert trained["optimizer_names"] == trained["state_names"] == adapters
    assert all(".lora_A." in n or ".lora_B." in n for n in adapters) and len(adapters) == 2 * 14  # 7 linears x 2 layers
    unchanged = [n for n in adapters if torch.equal(trained["adapters_before"][n], trained["adapters_after"][n])]
    assert unchanged == []
    assert max_abs_diff(trained["trained_lp"], trained["init_lp"]) > 1e-3  # the policy did move


def test_export_is_the_float64_merge_and_loads_in_plain_transformers(trained) -> None:
    from transformers import AutoModelForCausalLM

    export, adapters = trained["export"], trained["adapters"]
    hf_names = set(AutoModelForCausalLM.from_pretrained(trained["hf_dir"]).state_dict())
    assert set(export) <= hf_names and not any("lora" in n or "base_layer" in n for n in export)
    assert len(adapters) == 14
    worst = 0.0
    for name, (w, a, b, scaling) in adapters.items():
        expected = w.double() + scaling * (b.double() @ a.double())
        assert not torch.equal(expected.float(), w)  # the adapter changed the weight
        worst = max(worst, float((export[name].double() - expected).abs().max()))
    print(f"merged export vs float64 merge: max|d| = {worst:.1e}")
    assert worst <= 1e-6
    initial = _initial_weights(trained["path"])
    for name in set(export) - set(adapters):  # the frozen rest is sent as it is
        assert torch.equal(export[name], initial[name]), name
    # transformers alone (no LoRA code) on the saved directory computes the LoRA engine's logprobs
    hf = hf_reference_logprobs(trained["hf_dir"], trained["batch"].input_ids)
    diff = max_abs_diff(hf, trained["trained_lp"])
    print(f"save_hf -> from_pretrained vs the LoRA engine: max|dlogprob| = {diff:.1e}")
    assert diff <= 1e-5


def test_peft_loads_the_adapter_onto_the_base_model_as_the_merged_copy(trained) -> None:
    """The PEFT-format adapter save_hf writes beside the merged weights: the engine's own A and B (float32, under
    peft's key names), and peft, a LoRA implementation of its own, computes with it on the base model the logits of
    the merged copy in plain transformers."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    adapter_dir = f"{trained['hf_dir']}/adapter"
    saved = load_file(f"{adapter_dir}/adapter_model.safetensors")
    expected = {f"base_model.model.{weight.removesuffix('.weight')}.lora_{ab}.weight": t
                for weight, (_, a, b, _) in trained["adapters"].items() for ab, t in (("A", a), ("B", b))}
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in expected)

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained["path"], dtype=torch.float32),
                                           adapter_dir).eval()
    assert len({name for name, _ in peft_model.named_parameters() if ".lora_A." in name}) == len(trained["adapters"])
    merged = AutoModelForCausalLM.from_pretrained(trained["hf_dir"], dtype=torch.float32).eval()
    with torch.no_grad():
        ids = [seq[None] for seq in trained["batch"].input_ids]
        adapted = [peft_model(input_ids=x).logits for x in ids]
        with peft_model.disable_adapter():
            base = [peft_model(input_ids=x).logits for x in ids]
        reference = [merged(input_ids=x).logits for x in ids]
    diff = max_abs_diff(adapted, reference)
    print(f"peft (base + adapter) vs the merged HF copy: max|dlogit| = {diff:.1e}")
    assert diff <= 1e-5  # W x + s B A x against (W + s B A) x: rounding only
    assert max_abs_diff(adapted, base) > 1e-3  # the adapter does change the model


@pytest.mark.parametrize(("lora", "expected"), [
    ({}, ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]),
    ({"target_modules": ["*.self_attn.*"], "exclude_modules": ["o_proj"]}, ["k_proj", "q_proj", "v_proj"]),
    ({"target_modules": ["q_proj"], "exclude_modules": ["model.layers.0.*"]}, ["model.layers.1.self_attn.q_proj"]),
], ids=["every-linear", "glob", "one-layer-spared"])
def test_peft_target_modules_select_exactly_the_adapted_modules(ckpt, lora: dict, expected: list[str]) -> None:
    """adapter_config.json's target_modules, matched by peft itself on the base model, adapt the modules the engine
    adapted: leaf names where they name no other module, full names where a layer was spared."""
    from peft import LoraConfig, inject_adapter_in_model

    cfg = LoRAConfig(enabled=True, **lora)
    model = build_meta_model(ckpt(ARCH), "sdpa")
    apply_lora(model, cfg, frozen_dtype=torch.float32)
    config = peft_adapter_config(model, cfg, ckpt(ARCH))
    assert config["target_modules"] == expected
    base = inject_adapter_in_model(LoraConfig(**config), build_meta_model(ckpt(ARCH), "sdpa"))
    assert (sorted(name for name, module in base.named_modules() if hasattr(module, "lora_A"))
            == sorted(name for name, module in model.named_modules() if isinstance(module, LoRALinear)))


def test_reference_is_the_base_model_after_training(trained) -> None:
    # adapters off: exactly the initial (= base) computation, and the base model of a separate HF load
    assert all(torch.equal(a, b) for a, b in zip(trained["ref_lp"], trained["base_lp"]))
    assert_layout_close(trained["ref_lp"], hf_reference_logprobs(trained["path"], trained["batch"].input_ids))


def _initial_weights(path: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return dict(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict())


ADAMW = {"name": "AdamW", "kwargs": {"lr": 1e-4, "weight_decay": 0.01}}  # as test_parallel (Adam's sign noise)


def _two_steps(rank: int, world: int, path: str, batch, tp: int = 1) -> tuple[list[float], dict | None]:
    parallel = {"tensor_parallel_size": tp, "sequence_parallel": True} if tp > 1 else {}
    engine = DTensorEngine(make_policy(path, train_micro_batch_size=2, optimizer=ADAMW,
                                       dtensor_cfg={"lora_cfg": LORA, **parallel}))
    # this DP rank's share, uneven lengths per rank on purpose
    shard = batch.select(list(range(engine.dp_rank, len(batch), engine.dp_size)))
    losses = [engine.train_batch(shard, ClippedPGLoss())["loss"] for _ in range(2)]
    merged = dict(engine.export_hf_weights())
    return losses, merged if rank == 0 else None


@pytest.mark.distributed
def test_fsdp_two_ranks_equal_one_rank(ckpt) -> None:
    path = ckpt(ARCH)
    batch = grpo_batch(path)
    ((ref_losses, ref_merged),) = run_distributed(_two_steps, 1, args=(path, batch))
    (losses, merged), (losses_1, _) = run_distributed(_two_steps, 2, args=(path, batch))
    assert losses == losses_1
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    param_diff = max_abs_diff(merged, ref_merged)
    print(f"LoRA FSDP2 dp=2 vs 1 rank after 2 steps: max|dloss| = {loss_diff:.1e}, max|dmerged| = {param_diff:.1e}")
    assert loss_diff <= 1e-5 and param_diff <= 1e-5
    assert max_abs_diff(merged, _initial_weights(path)) > 1e-5  # the adapters did move the merged weights


@pytest.mark.slow
@pytest.mark.distributed
def test_fsdp_times_tensor_parallel_on_four_ranks_equals_one_rank(ckpt) -> None:
    path = ckpt("qwen3")
    batch = grpo_batch(path)
    ((ref_losses, ref_merged),) = run_distributed(_two_steps, 1, args=(path, batch))
    losses, merged = run_distributed(_two_steps, 4, args=(path, batch, 2))[0]  # dp=2 x tp=2, SP
    loss_diff = max(abs(a - b) for a, b in zip(losses, ref_losses))
    param_diff = max_abs_diff(merged, ref_merged)
    print(f"LoRA dp=2 x tp=2 (SP) vs 1 rank after 2 steps: max|dloss| = {loss_diff:.1e}, "
          f"max|dmerged| = {param_diff:.1e}")
    assert loss_diff <= 1e-6 and param_diff <= 1e-6
    assert max_abs_diff(merged, _initial_weights(path)) > 1e-5  # the adapters did move the merged weights


def _resume(rank: int, world: int, path: str, batch, ckpt_dir: str) -> tuple:
    policy = _policy(path)
    straight = DTensorEngine(policy)
    losses = [straight.train_batch(batch, ClippedPGLoss())["loss"] for _ in range(2)]
    first = DTensorEngine(policy)
    first.train_batch(batch, ClippedPGLoss())
    first.save_checkpoint(ckpt_dir)
    resumed = DTensorEngine(policy)
    resumed.snapshot_reference()  # as the trainer does: before the checkpoint is loaded
    resumed.load_checkpoint(ckpt_dir)
    resumed_loss = resumed.train_batch(batch, ClippedPGLoss())["loss"]
    return (losses, resumed_loss, dict(straight.export_hf_weights()), dict(resumed.export_hf_weights()),
            resumed.compute_ref_logprobs(batch))


@pytest.mark.distributed
def test_checkpoint_resume_is_exact(ckpt, tmp_path) -> None:
    path = ckpt(ARCH)
    batch = grpo_batch(path)
    ((losses, resumed_loss, params, resumed_params, ref),) = run_distributed(
        _resume, 1, args=(path, batch, str(tmp_path / "step1")))
    assert resumed_loss == losses[1]
    assert params.keys() == resumed_params.keys()
    assert all(torch.equal(params[n], resumed_params[n]) for n in params)
    assert_layout_close(ref, hf_reference_logprobs(path, batch.input_ids))  # the reference is still the base
    # the offline export merges the adapters (settings from the checkpoint's lora.json; bitwise equal to the live
    # save_hf in test_checkpoint_to_hf.py): the adapted weights differ from the base's, the others do not
    DTensorEngine.checkpoint_to_hf(str(tmp_path / "step1"), str(tmp_path / "hf"), model_dir=path)
    from safetensors.torch import load_file

    exported, initial = load_file(str(tmp_path / "hf" / "model.safetensors")), _initial_weights(path)
    changed = {name for name in exported if not torch.equal(exported[name], initial[name])}
    assert changed and all(name.endswith("_proj.weight") for name in changed)


def _train_and_checkpoint(rank: int, world: int, path: str, batch, ckpt_dir: str) -> None:
    engine = DTensorEngine(_policy(path))
    engine.train_batch(batch, ClippedPGLoss())
    engine.save_checkpoint(ckpt_dir)


@pytest.fixture(scope="module")
def lora_checkpoint(ckpt, tmp_path_factory) -> tuple[str, Path]:
    """(base model, checkpoint of a LoRA run after one step on it, FSDP over 2 ranks)."""
    path = ckpt(ARCH)
    ckpt_dir = tmp_path_factory.mktemp("lora") / "step1"
    run_distributed(_train_and_checkpoint, 2, args=(path, grpo_batch(path), str(ckpt_dir)))
    return path, ckpt_dir


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.distributed
def test_checkpoint_holds_the_adapters_alone_and_records_the_base(lora_checkpoint) -> None:
    """No frozen base tensor in the DCP checkpoint: the adapters and their AdamW state only, a fraction of the base
    model's size; lora.json names the base directory and its fingerprint."""
    import torch.distributed.checkpoint as dcp

    from rl_core.lora import BaseModel

    path, ckpt_dir = lora_checkpoint
    keys = sorted(dcp.FileSystemReader(str(ckpt_dir)).read_metadata().state_dict_metadata)
    model_keys = [key for key in keys if key.startswith("model.")]
    assert len(model_keys) == 2 * 7 * 2  # A and B of q, k, v, o, gate, up, down in 2 layers
    assert all(".lora_A." in key or ".lora_B." in key for key in keys if not key.startswith("optim.param_groups"))
    saved = json.loads((ckpt_dir / "lora.json").read_text())
    assert BaseModel.from_dict(saved["base_model"]) == BaseModel.of(path) and saved["base_dtype"] == "float32"
    weights = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    print(f"LoRA DCP checkpoint {_dir_bytes(ckpt_dir)} bytes, base model weights {weights} bytes")
    # the tiny model's adapters (dim 4) are 5% of its parameters, stored with AdamW's two moments; a checkpoint with
    # the frozen base held the base's bytes on top of them
    assert _dir_bytes(ckpt_dir) < weights


def _load_onto(rank: int, world: int, base: str, ckpt_dir: str) -> str:
    engine = DTensorEngine(_policy(base))
    try:
        engine.load_checkpoint(ckpt_dir)
    except ValueError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.distributed
def test_resume_onto_another_base_model_is_refused(lora_checkpoint) -> None:
    """The same shapes with other weights (another seed): the adapters would load onto a model they were not
    trained on."""
    from rl_core.testing.tiny_models import cached_tiny_checkpoint

    path, ckpt_dir = lora_checkpoint
    other = str(cached_tiny_checkpoint(ARCH, seed=1))
    (message,) = run_distributed(_load_onto, 1, args=(other, str(ckpt_dir)))
    assert message.startswith(f"LoRA checkpoint {ckpt_dir} was trained on the base model at {path} ")
    assert f"the base directory this run uses, {other}, holds another model" in message
    assert message.endswith("point policy.model_name at the base the run was trained from")
    assert run_distributed(_load_onto, 1, args=(path, str(ckpt_dir))) == ["loaded"]


def _full(engine: DTensorEngine) -> dict[str, torch.Tensor]:
    """Full tensors of every parameter, by module name (a collective under FSDP/TP)."""
    return {name: full_tensor(p).cpu().clone() for name, p in engine.model.named_parameters()}


def _tp_run(rank: int, world: int, path: str, batch, out_dir: str, sequence_parallel: bool) -> dict | None:
    """3 AdamW steps on the whole batch with TP over `world` ranks (1: no TP); save_hf and a checkpoint after
    them, a fresh engine that loads it, and one more step of both (rank 0's results)."""
    tp = {"tensor_parallel_size": world, "sequence_parallel": sequence_parallel} if world > 1 else {}
    policy = make_policy(path, train_micro_batch_size=2, optimizer=ADAMW, dtensor_cfg={"lora_cfg": LORA, **tp})
    engine = DTensorEngine(policy)
    out = {"init_lp": engine.compute_logprobs(batch), "before": _full(engine)}
    out["steps"] = [engine.train_batch(batch, ClippedPGLoss()) for _ in range(3)]
    out["after"], out["trained_lp"] = _full(engine), engine.compute_logprobs(batch)
    out["trainable"] = sorted(name for name, p in engine.model.named_parameters() if p.requires_grad)
    out["export"] = {name: t.cpu() for name, t in engine.export_hf_weights()}
    engine.save_hf(f"{out_dir}/hf")
    engine.save_checkpoint(f"{out_dir}/ckpt")
    resumed = DTensorEngine(policy)
    resumed.load_checkpoint(f"{out_dir}/ckpt")
    out["loaded"] = _full(resumed)
    out["next_losses"] = [e.train_batch(batch, ClippedPGLoss())["loss"] for e in (engine, resumed)]
    out["continued"], out["resumed"] = _full(engine), _full(resumed)
    return out if rank == 0 else None


TP_LAYOUTS = [("qwen2", False), ("qwen2", True), ("qwen3", True)]  # qwen3: q_norm / k_norm (HeadShardedNorm)


@pytest.fixture(scope="module")
def one_process_runs(ckpt, tmp_path_factory) -> Callable[[str], dict]:
    """arch -> the 1-process run without TP (`_tp_run`), computed once per arch."""
    runs: dict[str, dict] = {}

    def get(arch: str) -> dict:
        if arch not in runs:
            out_dir = str(tmp_path_factory.mktemp(f"lora-{arch}-1"))
            (runs[arch],) = run_distributed(_tp_run, 1, args=(ckpt(arch), grpo_batch(ckpt(arch)), out_dir, False))
            runs[arch]["dir"] = out_dir
        return runs[arch]

    return get


@pytest.fixture(scope="module", params=TP_LAYOUTS, ids=[f"{a}-sp{int(sp)}" for a, sp in TP_LAYOUTS])
def tp_runs(request, ckpt, one_process_runs, tmp_path_factory) -> dict:
    """The TP=2 run of one (arch, sequence_parallel) layout beside the 1-process run of its arch."""
    arch, sequence_parallel = request.param
    out_dir = str(tmp_path_factory.mktemp(f"lora-{arch}-tp2"))
    batch = grpo_batch(ckpt(arch))
    tp, _ = run_distributed(_tp_run, 2, args=(ckpt(arch), batch, out_dir, sequence_parallel))
    return {"tp": {**tp, "dir": out_dir}, "ref": one_process_runs(arch), "path": ckpt(arch), "batch": batch,
            "layout": f"{arch} TP=2 sp={sequence_parallel}"}


def _split(params: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(adapter parameters, base parameters) of `_full`'s output."""
    adapters = {n: t for n, t in params.items() if ".lora_" in n}
    return adapters, {n: t for n, t in params.items() if n not in adapters}


@pytest.mark.distributed
def test_tensor_parallel_training_equals_one_process(tp_runs) -> None:
    """TP=2 (sharded base and adapters) computes what 1 process without TP computes: the base model at
    initialisation, then the same losses, adapters and logprobs; only the adapters train, the base stays bitwise."""
    tp, ref, layout = tp_runs["tp"], tp_runs["ref"], tp_runs["layout"]
    init_diff = assert_layout_close(tp["init_lp"], hf_reference_logprobs(tp_runs["path"], tp_runs["batch"].input_ids))
    adapters, base = _split(tp["after"])
    adapters_before, base_before = _split(tp["before"])
    assert tp["trainable"] == sorted(adapters) and len(adapters) == 2 * 14  # 7 linears x 2 layers, A and B
    assert [n for n in base if not torch.equal(base[n], base_before[n])] == []
    assert max_abs_diff(adapters, adapters_before) > 1e-4  # the steps moved the adapters (lr 1e-4)
    loss_diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(tp["steps"], ref["steps"]))
    # the norm of the adapters' gradients (replicated ones counted once, not once per TP rank), clipping's input
    assert [s["grad_norm"] for s in tp["steps"]] == pytest.approx([s["grad_norm"] for s in ref["steps"]], rel=1e-6)
    adapter_diff = max_abs_diff(adapters, _split(ref["after"])[0])
    lp_diff = max_abs_diff(tp["trained_lp"], ref["trained_lp"])
    print(f"LoRA {layout} vs 1 process: init vs HF max|dlogprob| = {init_diff:.1e}; after 3 steps max|dloss| = "
          f"{loss_diff:.1e}, max|dadapter| = {adapter_diff:.1e}, max|dlogprob| = {lp_diff:.1e}")
    assert loss_diff <= 1e-6 and adapter_diff <= 1e-6 and lp_diff <= 1e-5


@pytest.mark.distributed
def test_tensor_parallel_export_and_peft_adapter_equal_one_process(tp_runs) -> None:
    """The merged export (refit), save_hf's PEFT adapter and the offline checkpoint_to_hf of the TP-sharded
    checkpoint give the 1-process run's tensors."""
    from safetensors.torch import load_file

    tp, ref = tp_runs["tp"], tp_runs["ref"]
    export_diff = max_abs_diff(tp["export"], ref["export"])
    adapter_file = "hf/adapter/adapter_model.safetensors"
    peft_tp, peft_ref = (load_file(f"{run['dir']}/{adapter_file}") for run in (tp, ref))
    peft_diff = max_abs_diff(peft_tp, peft_ref)
    assert len(peft_tp) == 28
    tp_config, ref_config = (json.loads(Path(f"{run['dir']}/hf/adapter/adapter_config.json").read_text())
                             for run in (tp, ref))
    assert tp_config == ref_config
    offline = f"{tp['dir']}/offline"
    DTensorEngine.checkpoint_to_hf(f"{tp['dir']}/ckpt", offline, model_dir=tp_runs["path"])
    live, exported = load_file(f"{tp['dir']}/hf/model.safetensors"), load_file(f"{offline}/model.safetensors")
    assert live.keys() == exported.keys() and all(torch.equal(live[n], exported[n]) for n in live)
    assert all(torch.equal(peft_tp[n], t) for n, t in load_file(f"{offline}/adapter/adapter_model.safetensors").items())
    print(f"LoRA {tp_runs['layout']} vs 1 process: merged export max|d| = {export_diff:.1e}, "
          f"PEFT adapter max|d| = {peft_diff:.1e}")
    assert export_diff <= 1e-6 and peft_diff <= 1e-6
    assert max_abs_diff(tp["export"], _initial_weights(tp_runs["path"])) > 1e-5  # the merge moved the weights


@pytest.mark.distributed
def test_tensor_parallel_checkpoint_resume_is_exact(tp_runs) -> None:
    tp = tp_runs["tp"]
    assert all(torch.equal(tp["loaded"][n], t) for n, t in tp["after"].items())  # adapters and base, full
    assert tp["next_losses"][0] == tp["next_losses"][1]  # the optimizer state came back too
    assert all(torch.equal(tp["resumed"][n], t) for n, t in tp["continued"].items())


@pytest.mark.parametrize(("lora", "tp", "key"), [
    ({"dim": 0}, 1, "lora_cfg.dim"),
    ({"alpha": 0.0}, 1, "lora_cfg.alpha"),
    ({"dropout": 1.0}, 1, "lora_cfg.dropout"),
    ({"dropout": 0.1}, 2, "lora_cfg.dropout=0 or tensor_parallel_size=1"),  # one mask per TP group: CUDA only
    ({"droput": 0.1}, 1, "did you mean 'policy.dtensor_cfg.lora_cfg.dropout'"),  # unknown: the closest key
])
def test_config_errors_name_the_key(ckpt, lora: dict, tp: int, key: str) -> None:
    policy = make_policy(ckpt(ARCH), dtensor_cfg={"tensor_parallel_size": tp, "lora_cfg": {"enabled": True, **lora}})
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        DTensorConfig.from_policy(policy)


def _build(rank: int, world: int, path: str, lora: dict) -> None:
    DTensorEngine(_policy(path, lora))


def test_unknown_target_lists_the_leaf_names(ckpt, tmp_path) -> None:
    """In the engine, and before any worker in `check_model` (the trainer's preflight), from config.json alone."""
    typo = {**LORA, "target_modules": ["q_proj", "qproj"]}
    message = r"target_modules: \['qproj'\] match no nn.Linear.*'q_proj'"
    with pytest.raises(RuntimeError, match=message):
        run_distributed(_build, 1, args=(ckpt(ARCH), typo))
    no_weights = tmp_path  # config.json only
    shutil.copy(Path(ckpt(ARCH)) / "config.json", no_weights)
    with pytest.raises(ValueError, match=message):
        DTensorEngine.check_model(_policy(str(no_weights), typo))
    DTensorEngine.check_model(_policy(str(no_weights), {**LORA, "exclude_modules": ["*.mlp.*"]}))
    with pytest.raises(ValueError, match=r"exclude_modules: \['gate'\] match no nn.Linear"):
        DTensorEngine.check_model(_policy(str(no_weights), {**LORA, "exclude_modules": ["gate"]}))


def test_targets_by_leaf_name_or_glob_and_excludes(ckpt) -> None:
    model = build_meta_model(ckpt(ARCH), "sdpa")
    cfg = LoRAConfig(enabled=True, target_modules=["*.self_attn.*", "up_proj"], exclude_modules=["o_proj"])
    apply_lora(model, cfg, frozen_dtype=torch.float32)
    wrapped = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LoRALinear)})
    assert wrapped == ["k_proj", "q_proj", "up_proj", "v_proj"]
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == sorted(
        f"{n}.{ab}.weight" for n, m in model.named_modules() if isinstance(m, LoRALinear) for ab in ("lora_A", "lora_B"))


def _bf16(rank: int, world: int, path: str, batch, hf_dir: str) -> dict:
    plain = DTensorEngine(make_policy(path, train_micro_batch_size=2, precision="bfloat16"))
    engine = DTensorEngine(_policy(path, precision="bfloat16"))
    out = {"plain_lp": plain.compute_logprobs(batch), "lora_lp": engine.compute_logprobs(batch),
           "dtypes": {name: p.dtype for name, p in engine.model.named_parameters()}}
    out["loss"] = engine.train_batch(batch, ClippedPGLoss())["loss"]
    out["export_dtypes"] = {name: t.dtype for name, t in engine.export_hf_weights()}
    engine.save_hf(hf_dir)
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_keeps_the_frozen_base_in_bf16_with_the_same_results(ckpt, backend, tmp_path) -> None:
    """bf16 storage of the frozen base: FSDP casts float32 weights to bf16 for every forward, so storing them in
    bf16 computes the same bits (at half the memory); the adapters keep float32 master weights. The HF copy holds
    the merged weights in bf16 and its config.json says so (the tiny base's says float32)."""
    path = ckpt(ARCH)
    batch = grpo_batch(path)
    (out,) = run_distributed(_bf16, 1, args=(path, batch, str(tmp_path / "hf")), backend=backend)
    assert json.loads((tmp_path / "hf/config.json").read_text())["dtype"] == "bfloat16"
    assert all(torch.equal(a, b) for a, b in zip(out["lora_lp"], out["plain_lp"]))
    assert {n for n, d in out["dtypes"].items() if d == torch.float32} == {n for n in out["dtypes"] if ".lora_" in n}
    assert set(out["dtypes"].values()) == {torch.float32, torch.bfloat16}
    assert set(out["export_dtypes"].values()) == {torch.bfloat16} and torch.isfinite(torch.tensor(out["loss"]))


def _dropout_grads(rank: int, world: int, path: str, batch, ac: bool) -> list[dict[str, torch.Tensor]]:
    """Adapter gradients of one forward/backward under seeds 0 and 1 (other dropout masks)."""
    dtensor_cfg = {"activation_checkpointing": ac, "lora_cfg": {**LORA, "dropout": 0.5}}
    engine = DTensorEngine(make_policy(path, train_micro_batch_size=2, dtensor_cfg=dtensor_cfg))
    grads = []
    torch.manual_seed(2)
    engine.train_batch(batch, ClippedPGLoss())  # B != 0: A gets gradients too
    for seed in (0, 1):
        torch.manual_seed(seed)
        engine.forward_backward(batch, ClippedPGLoss())
        grads.append(full_grads(engine))
        engine.zero_grad()
    return grads


def test_dropout_masks_survive_activation_checkpointing(ckpt) -> None:
    """The recomputed forward draws the dropout masks of the first one: AC changes no gradient."""
    path = ckpt(ARCH)
    batch = grpo_batch(path)
    plain, checkpointed = (run_distributed(_dropout_grads, 1, args=(path, batch, ac))[0] for ac in (False, True))
    assert max_abs_diff(plain[0], plain[1]) > 1e-3  # the dropout is applied: another seed, other gradients
    assert max_abs_diff(plain[0], checkpointed[0]) <= 1e-6
