"""The GPU placement group asks Ray for exactly the GPUs the layout uses, and never waits silently for GPUs
a local machine does not have (found on a one-GPU machine: gpu_1x.yaml asked for two one-GPU bundles and
Ray waited forever). Ray's placement calls are simulated: this CPU machine has no GPU to place."""

from __future__ import annotations

import logging
import sys

import pytest
import ray
import ray.util.placement_group  # noqa: F401 - the module, looked up in sys.modules (ray.util's name is the function)

from grpo_app import cluster
from grpo_app.config import CONFIG_DIR, load_config
from grpo_app.devices import Hardware
from rl_core.config import ConfigError

ONE_GPU = Hardware(cuda_available=True, bf16_supported=True, num_gpus=1)
EIGHT_GPUS = Hardware(cuda_available=True, bf16_supported=True, num_gpus=8)


class FakeRay:
    """Records the placement group asked for; `ready` succeeds when the cluster has enough GPUs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpus: int, place_after_waits: int = 0) -> None:
        self.bundles: list[dict] | None = None
        self.waits_left = place_after_waits
        monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": float(gpus)})
        monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 16.0, "GPU": 0.0})
        monkeypatch.setattr(sys.modules["ray.util.placement_group"], "placement_group", self.placement_group)
        monkeypatch.setattr(ray, "get", self.get)

    def placement_group(self, bundles: list[dict], strategy: str) -> FakeRay:
        assert strategy == "PACK"
        self.bundles = bundles
        return self

    def ready(self) -> str:
        return "ready"

    def get(self, ref: str, timeout: float | None = None) -> None:
        if self.waits_left:
            self.waits_left -= 1
            raise ray.exceptions.GetTimeoutError("not placed yet")


@pytest.mark.parametrize("config,overrides,hardware,expected_bundles", [
    # the generator in the policy process (gpu_1x.yaml: colocated false) needs no GPU of its own
    (CONFIG_DIR / "gpu_1x.yaml", [], ONE_GPU, 1),
    (None, [], ONE_GPU, 1),  # the default run on one GPU: colocated, in the policy ranks
    (None, ["cluster.train_world_size=4", "policy.train_global_batch_size=16"], EIGHT_GPUS, 4),
    # separate generation workers on GPUs of their own come after the policy's
    (None, ["cluster.train_world_size=4", "policy.train_global_batch_size=16", "generation.colocated=false",
            "generation.in_policy_workers=false", "generation.num_workers=2"], EIGHT_GPUS, 6),
])
def test_placement_group_has_one_bundle_per_gpu_used(monkeypatch, config, overrides, hardware, expected_bundles):
    fake = FakeRay(monkeypatch, gpus=hardware.num_gpus)
    cfg = load_config(config, overrides, hardware=hardware)
    placement = cluster.Placement(cfg)
    assert fake.bundles == [{"GPU": 1, "CPU": 1}] * expected_bundles
    world = cfg.cluster.train_world_size
    policy = [placement.policy_options(r)["scheduling_strategy"].placement_group_bundle_index for r in range(world)]
    assert policy == list(range(world))
    if not cfg.generation.in_policy_workers:
        first = placement.generation_options(0)
        assert first["num_gpus"] == 1.0 and first["scheduling_strategy"].placement_group_bundle_index == world


def test_a_local_ray_without_the_gpus_is_a_config_error_not_a_silent_wait(monkeypatch):
    FakeRay(monkeypatch, gpus=1, place_after_waits=10**9)
    cfg = load_config(None, ["cluster.gpus_per_node=2", "cluster.train_world_size=2",
                             "policy.train_global_batch_size=16"], hardware=ONE_GPU)
    with pytest.raises(ConfigError, match=r"needs 2 GPU\(s\) but Ray sees 1 .*cluster.gpus_per_node"):
        cluster.Placement(cfg)


def test_a_cluster_that_can_grow_is_waited_for_with_a_warning(monkeypatch, caplog):
    fake = FakeRay(monkeypatch, gpus=0, place_after_waits=2)
    with caplog.at_level(logging.WARNING, logger="grpo_app.cluster"):
        cluster.wait_for_placement(fake, 8, can_grow=True, every_s=0.01)
    assert caplog.text.count("one-GPU bundles: the Ray cluster has 0 GPU(s)") == 2


@pytest.mark.parametrize("cuda", [True, False])
def test_policy_ranks_join_a_group_that_reduces_host_tensors(monkeypatch, cuda: bool) -> None:
    """On GPUs the policy ranks' default group was NCCL alone, and megatron's DP group inherits it: the
    engine's all-reduce of its host-side token counts raised "No backend type associated with device type
    cpu" with more than one DP rank. The group carries gloo for CPU tensors beside NCCL."""
    import torch
    import torch.distributed as dist

    from grpo_app.refit import tcp_store
    from grpo_app.workers import join_policy_group

    joined = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: joined.update(backend=backend, **kw))
    join_policy_group(0, 1, tcp_store("127.0.0.1", 0, 1, True))
    assert joined["backend"] == ("cpu:gloo,cuda:nccl" if cuda else "gloo")
    assert (joined["rank"], joined["world_size"]) == (0, 1)


def test_a_cpu_run_places_policy_ranks_and_generation_workers_anywhere():
    """No GPUs, no placement group: every actor's options are plain (an index into the GPU bundles
    failed here for the generation workers of the CPU default)."""
    placement = cluster.Placement(load_config(None, ["cluster.train_world_size=2", "generation.num_workers=2"]))
    options = [placement.policy_options(r) for r in range(2)] + [placement.generation_options(i) for i in range(2)]
    assert options == [{"num_cpus": 0, "num_gpus": 0}] * 4


@pytest.mark.parametrize(("overrides", "cores", "threads"), [
    ((), 2, 2),  # policy and generator take turns: each gets every core
    (("grpo.async_rollouts=true", "generation.colocated=false"), 2, 1),  # side by side: one core each
    (("grpo.async_rollouts=true", "generation.colocated=false", "cluster.train_world_size=2",
      "generation.num_workers=2"), 8, 2),
    (("cluster.train_world_size=2",), 1, 1),
])
def test_cpu_threads_split_the_cores_among_the_processes_that_compute_at_once(overrides, cores, threads):
    cfg = load_config(None, ["policy.model_name=unused", *overrides], hardware=Hardware(False, False, 0))
    assert cluster.cpu_threads(cfg, cores) == threads
