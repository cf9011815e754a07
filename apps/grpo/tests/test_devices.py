"""The layout decisions, table-driven with simulated hardware: `auto` device/precision/generator placement
(grpo_app.devices) and the refit path per placement (grpo_app.refit.refit_path)."""

from __future__ import annotations

import logging

import pytest

from grpo_app.config import CONFIG_DIR, load_config
from grpo_app.devices import Hardware, check_hardware
from grpo_app.refit import RefitPath, refit_path
from rl_core.config import ConfigError

NO_GPU = Hardware(cuda_available=False, bf16_supported=False, num_gpus=0)
ONE_GPU = Hardware(cuda_available=True, bf16_supported=True, num_gpus=1)
ONE_OLD_GPU = Hardware(cuda_available=True, bf16_supported=False, num_gpus=1)  # e.g. a T4: no bf16
EIGHT_GPUS = Hardware(cuda_available=True, bf16_supported=True, num_gpus=8)

# (hardware, overrides) -> (device, gpus_per_node, precision, in_policy_workers, generator device, generator dtype)
AUTO_CASES = [
    (NO_GPU, [], ("cpu", 0, "float32", False, "cpu", "float32")),
    (ONE_GPU, [], ("cuda", 1, "bfloat16", True, "cuda", "bfloat16")),
    (ONE_OLD_GPU, [], ("cuda", 1, "float32", True, "cuda", "float32")),
    (EIGHT_GPUS, [], ("cuda", 8, "bfloat16", True, "cuda", "bfloat16")),
    # explicit values win over auto
    (ONE_GPU, ["cluster.device=cpu"], ("cpu", 0, "float32", False, "cpu", "float32")),
    (ONE_GPU, ["policy.precision=float32"], ("cuda", 1, "float32", True, "cuda", "float32")),
    (ONE_GPU, ["generation.backend_kwargs.dtype=float32"], ("cuda", 1, "bfloat16", True, "cuda", "float32")),
    (EIGHT_GPUS, ["cluster.gpus_per_node=2"], ("cuda", 2, "bfloat16", True, "cuda", "bfloat16")),
    (NO_GPU, ["generation.in_policy_workers=true"], ("cpu", 0, "float32", True, "cpu", "float32")),
    # a cluster's head may have no GPU: gpus_per_node > 0 means cuda, and bf16 is assumed
    (NO_GPU, ["cluster.address=auto", "cluster.gpus_per_node=8", "cluster.train_world_size=8"],
     ("cuda", 8, "bfloat16", True, "cuda", "bfloat16")),
]


@pytest.mark.parametrize("hardware,overrides,expected", AUTO_CASES)
def test_auto_device_precision_and_generator(hardware, overrides, expected):
    cfg = load_config(None, overrides, hardware=hardware)
    kwargs = cfg.generation.backend_kwargs
    got = (cfg.cluster.device, cfg.cluster.gpus_per_node, cfg.policy.precision, cfg.generation.in_policy_workers,
           kwargs["device"], kwargs["dtype"])
    assert got == expected


def test_a_precision_spelt_as_elsewhere_is_named_with_the_spelling_here():
    """`bf16` (verl's spelling) got a list of choices without `auto`, which this key accepts."""
    with pytest.raises(ConfigError, match=r"^policy.precision='bf16': choose one of \['auto', 'float32', 'bfloat16', "
                                          r"'float16'\] \(bf16 is spelt bfloat16 here\)$"):
        load_config(None, ["policy.precision=bf16"], hardware=ONE_GPU)


def test_generator_on_cpu_while_policy_on_gpu_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="grpo_app.devices"):
        cfg = load_config(None, ["generation.backend_kwargs.device=cpu"], hardware=ONE_GPU)
    assert cfg.generation.backend_kwargs["device"] == "cpu"  # the user's value stands, with a warning
    assert "generation.backend_kwargs.device=cpu while the policy trains on cuda" in caplog.text


def test_vllm_in_policy_ranks_uses_external_launcher():
    cfg = load_config(None, ["generation.backend=vllm", "cluster.train_world_size=4",
                             "policy.train_global_batch_size=16"], hardware=EIGHT_GPUS)
    assert cfg.generation.in_policy_workers
    # no vLLM data_parallel_size: every rank (TP group) is an independent replica, not a lockstep DP rank
    # Ray shows each rank one GPU: vLLM's custom all-reduce (indexing CUDA_VISIBLE_DEVICES by TP rank) is off
    assert cfg.generation.backend_kwargs == {"dtype": "bfloat16", "distributed_executor_backend": "external_launcher",
                                             "disable_custom_all_reduce": True}


def test_a_third_party_backend_gets_only_the_keys_its_user_sets():
    """`dtype`, vLLM's executor and all-reduce keys are the built-in backends'; a plug-in backend whose constructor
    does not take them was refused in preflight ('unknown config key generation.backend_kwargs.dtype')."""
    for hardware in (NO_GPU, ONE_GPU, EIGHT_GPUS):
        cfg = load_config(None, ["generation.backend=mygen", "generation.backend_kwargs.max_batch=4"],
                          hardware=hardware)
        assert cfg.generation.backend_kwargs == {"max_batch": 4}
    assert load_config(None, ["generation.backend=mygen", "generation.in_policy_workers=true"],
                       hardware=NO_GPU).generation.backend_kwargs == {}


VLLM_IN_POLICY = ["generation.backend=vllm", "generation.in_policy_workers=true", "cluster.train_world_size=4",
                  "policy.train_global_batch_size=16"]
# vLLM inside the policy ranks: layouts that cannot work -> (hardware, overrides, the error names this)
BAD_VLLM_IN_POLICY = [
    (EIGHT_GPUS, ["generation.backend_kwargs.tensor_parallel_size=3"],
     "tensor_parallel_size=3 must divide cluster.train_world_size=4"),
    (EIGHT_GPUS, ["generation.backend_kwargs.tensor_parallel_size=0"], "tensor_parallel_size=0 must be >= 1"),
    (EIGHT_GPUS, ["generation.backend_kwargs.data_parallel_size=4"], "data_parallel_size=4 .* remove the key"),
    (NO_GPU, ["generation.backend_kwargs.tensor_parallel_size=2"], "errno: 17"),
    (NO_GPU, ["generation.backend_kwargs.enable_sleep_mode=true"], "CPU backend has no sleep mode"),
]


@pytest.mark.parametrize("hardware,overrides,message", BAD_VLLM_IN_POLICY)
def test_vllm_in_policy_layouts_that_cannot_work_fail_at_config_time(hardware, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, VLLM_IN_POLICY + overrides, hardware=hardware)


def test_vllm_in_policy_tensor_parallel_on_gpus():
    cfg = load_config(None, VLLM_IN_POLICY + ["generation.backend_kwargs.tensor_parallel_size=2"], hardware=EIGHT_GPUS)
    assert cfg.generation.backend_kwargs["tensor_parallel_size"] == 2  # allowed on GPUs (refused on CPU above)
    assert refit_path(cfg) is RefitPath.IN_PROCESS


# (hardware, overrides) -> the refit path
REFIT_CASES = [
    (NO_GPU, ["generation.in_policy_workers=false"], RefitPath.GLOO),
    (NO_GPU, ["generation.in_policy_workers=false", "generation.colocated=false"], RefitPath.GLOO),
    (NO_GPU, ["generation.in_policy_workers=true"], RefitPath.IN_PROCESS),
    (ONE_GPU, [], RefitPath.IN_PROCESS),  # the default on one GPU
    (EIGHT_GPUS, ["cluster.train_world_size=4"], RefitPath.IN_PROCESS),
    # in the policy process without offload/sleep (gpu_1x.yaml): no GPU of its own needed
    (ONE_GPU, ["generation.in_policy_workers=true", "generation.colocated=false"], RefitPath.IN_PROCESS),
    (EIGHT_GPUS, ["generation.colocated=false", "generation.num_workers=2"], RefitPath.NCCL),
    (EIGHT_GPUS, ["generation.colocated=false", "cluster.train_world_size=6", "generation.num_workers=2"],
     RefitPath.NCCL),
]


@pytest.mark.parametrize("hardware,overrides,expected", REFIT_CASES)
def test_refit_path_per_placement(hardware, overrides, expected):
    assert refit_path(load_config(None, overrides, hardware=hardware)) is expected


# layouts that cannot work: (hardware, overrides, the error names these keys)
BAD_LAYOUTS = [
    # two NCCL ranks on one GPU
    (ONE_GPU, ["generation.in_policy_workers=false"], "generation.colocated=true with generation.in_policy_workers"),
    (EIGHT_GPUS, ["generation.in_policy_workers=false", "generation.backend=vllm"], "NCCL refuses"),
    # more GPUs than the cluster section gives
    (ONE_GPU, ["generation.colocated=false"], r"needs 2 GPUs \(cluster.train_world_size=1 \+ generation.num_workers"),
    (EIGHT_GPUS, ["cluster.train_world_size=16"], "cluster.gpus_per_node x num_nodes = 8"),
    (EIGHT_GPUS, ["generation.colocated=false", "cluster.train_world_size=8"], "needs 9 GPUs"),
    # a separate generation worker has one GPU: vLLM cannot shard over two
    (EIGHT_GPUS, ["generation.backend=vllm", "generation.in_policy_workers=false", "generation.colocated=false",
                  "cluster.train_world_size=4", "generation.backend_kwargs.tensor_parallel_size=2"],
     "tensor_parallel_size=2 with generation.in_policy_workers=false on GPUs"),
    # contradictions
    (ONE_GPU, ["cluster.device=cpu", "cluster.gpus_per_node=1"], "cluster.device=cpu but cluster.gpus_per_node=1"),
    (NO_GPU, ["cluster.device=tpu"], r"cluster.device='tpu'; choose one of"),
    (NO_GPU, ["cluster.device=cuda", "cluster.address=auto"], "set cluster.gpus_per_node"),
]


@pytest.mark.parametrize("hardware,overrides,message", BAD_LAYOUTS)
def test_impossible_layouts_fail_at_config_time(hardware, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides, hardware=hardware)


# hardware checks of a local run (preflight): (hardware, overrides of a config built for 8 GPUs, message)
HARDWARE_CASES = [
    (NO_GPU, [], "no usable CUDA GPU"),
    (ONE_GPU, [], "cluster.gpus_per_node=8 but this machine has 1 GPU"),
    (EIGHT_GPUS, ["cluster.num_nodes=2"], "cluster.num_nodes=2 needs a Ray cluster"),
]


@pytest.mark.parametrize("hardware,overrides,message", HARDWARE_CASES)
def test_local_run_asks_for_no_more_than_the_machine_has(hardware, overrides, message):
    cfg = load_config(None, ["cluster.gpus_per_node=8", *overrides], hardware=EIGHT_GPUS)
    with pytest.raises(ConfigError, match=message):
        check_hardware(cfg.cluster, hardware)
    check_hardware(load_config(None, ["cluster.gpus_per_node=8"], hardware=EIGHT_GPUS).cluster, EIGHT_GPUS)
    joined = load_config(None, ["cluster.gpus_per_node=8", "cluster.address=auto", *overrides], hardware=NO_GPU)
    check_hardware(joined.cluster, NO_GPU)  # a cluster's GPUs are Ray's to count, not the driver's


def test_cuda_without_a_gpu_says_so_before_the_layout_checks():
    """`cluster.device=cuda` with the GPU count left to the machine: the missing GPU is the error, not the layout."""
    with pytest.raises(ConfigError, match="no usable CUDA GPU"):
        load_config(None, ["cluster.device=cuda"], hardware=NO_GPU)


def test_gpu_1x_recipe_resolves_to_one_gpu():
    cfg = load_config(CONFIG_DIR / "gpu_1x.yaml", hardware=ONE_GPU)
    assert (cfg.cluster.device, cfg.cluster.gpus_per_node, cfg.cluster.train_world_size) == ("cuda", 1, 1)
    assert cfg.policy.precision == "bfloat16" and cfg.generation.backend_kwargs["device"] == "cuda"
    assert refit_path(cfg) is RefitPath.IN_PROCESS and not cfg.generation.colocated  # resident, no offload
    check_hardware(cfg.cluster, ONE_GPU)
    with pytest.raises(ConfigError, match="no usable CUDA GPU"):
        check_hardware(load_config(CONFIG_DIR / "gpu_1x.yaml", hardware=NO_GPU).cluster, NO_GPU)


def test_qwen2_5_0_5b_shape_has_the_published_layer_sizes():
    """Parameter count of the shape (on the meta device) against the count from the published sizes."""
    import torch
    from transformers import AutoModelForCausalLM

    from grpo_app.model_shapes import shape_config

    config = shape_config("qwen2.5-0.5b")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    h, inter, layers, kv = 896, 4864, 24, 2 * 64  # 2 kv heads of head_dim 896 / 14 = 64
    attention = h * h + h + 2 * (h * kv + kv) + h * h  # q (+bias), k and v (+bias), o
    per_layer = attention + 3 * h * inter + 2 * h  # gate/up/down, two norms
    assert sum(p.numel() for p in model.parameters()) == 128 * h + layers * per_layer + h  # tied head
    with pytest.raises(ValueError, match="known shapes are"):
        shape_config("qwen9-1t")


def test_detecting_the_hardware_creates_no_cuda_context_in_the_driver(monkeypatch):
    """`torch.cuda.is_bf16_supported` creates a CUDA context (`_lazy_init`), which the driver would hold on GPU 0
    for the whole run; the driver asks a child process instead (here, with no GPU, the child answers False)."""
    import torch

    from grpo_app import devices

    def no_context(*args, **kwargs):
        raise AssertionError("a CUDA context was created in the driver")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "_lazy_init", no_context)
    devices._native_bf16.cache_clear()
    assert devices.detect_hardware() == Hardware(cuda_available=True, bf16_supported=False, num_gpus=2)
    devices._native_bf16.cache_clear()
