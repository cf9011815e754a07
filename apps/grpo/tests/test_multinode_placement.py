"""Multi-node placement on a simulated Ray cluster (ray.cluster_utils.Cluster: three raylets on this machine
with fake GPUs; nothing here touches CUDA).

- Ray's PACK numbers the bundles of more than 16 identical one-GPU bundles across nodes in no node order
  (an unstable std::sort before filling node after node), so "policy rank r = bundle r" put ranks 0 and
  9-15 on one node and 1-8 on another: tensor-parallel groups and vLLM replicas crossed nodes. Ranks are
  now node-major over the nodes Ray actually chose.
- Workers run in the directory `ray start` ran in on their node, not the driver's: a relative checkpoint
  path put every rank's shard elsewhere than the directory the driver then published.
- A checkpoint directory the ranks' nodes cannot see, and a placement a cluster never grants, are errors
  that name the keys instead of a broken checkpoint or a silent wait.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group_table

from grpo_app import cluster
from grpo_app.cluster import Placement, Workers, check_shared_dir, node_major_bundles
from grpo_app.colocation import Colocation
from grpo_app.config import load_config
from rl_core.config import ConfigError

pytestmark = pytest.mark.distributed

GPUS_PER_NODE = 8
NODES = 3


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, Path]]:
    """Three nodes of 8 fake GPUs whose raylets (and so their workers) run in `node_cwd`, as `ray start`
    run from another directory than the driver's would; yields the cluster and that directory."""
    if ray.is_initialized():
        ray.shutdown()
    node_cwd = tmp_path_factory.mktemp("ray-start-cwd")
    previous_cwd, previous_auth = os.getcwd(), os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # the CPU lane hides GPUs with CUDA_VISIBLE_DEVICES="", and Ray refuses fake GPUs beside that
    hidden_gpus = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    os.chdir(node_cwd)
    try:
        nodes = Cluster(initialize_head=True,
                        head_node_args={"num_cpus": GPUS_PER_NODE, "num_gpus": GPUS_PER_NODE})
        for _ in range(NODES - 1):
            nodes.add_node(num_cpus=GPUS_PER_NODE, num_gpus=GPUS_PER_NODE)
    finally:
        os.chdir(previous_cwd)
        if hidden_gpus is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden_gpus
    ray.init(address=nodes.address)
    nodes.wait_for_nodes()
    try:
        yield nodes, node_cwd
    finally:
        ray.shutdown()
        nodes.shutdown()
        if previous_auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = previous_auth


def _config(ray_cluster: tuple[Cluster, Path], nodes: int, world: int, generation_workers: int = 0) -> object:
    overrides = [f"cluster.address={ray_cluster[0].address}", f"cluster.num_nodes={nodes}",
                 f"cluster.gpus_per_node={GPUS_PER_NODE}", f"cluster.train_world_size={world}",
                 "grpo.num_prompts_per_step=12", "grpo.num_generations_per_prompt=8",
                 "policy.train_global_batch_size=96"]
    if generation_workers:
        overrides += ["generation.colocated=false", "generation.in_policy_workers=false",
                      f"generation.num_workers={generation_workers}"]
    return load_config(None, overrides)


def _node_of(placement: Placement, options: dict) -> str:
    bundle = options["scheduling_strategy"].placement_group_bundle_index
    return placement_group_table(placement.group)["bundles_to_node_id"][bundle]


@pytest.mark.parametrize("world, generation_workers", [(24, 0), (16, 8)])
def test_policy_ranks_are_node_major(ray_cluster, monkeypatch, world: int, generation_workers: int) -> None:
    cfg = _config(ray_cluster, NODES, world, generation_workers)
    placement = Placement(cfg)
    try:
        policy = [_node_of(placement, placement.policy_options(r)) for r in range(world)]
        # rank r on node r // gpus_per_node: each block of 8 ranks on one node, the blocks on different nodes
        assert all(policy[r] == policy[r - r % GPUS_PER_NODE] for r in range(world)), policy
        assert len(set(policy)) == world // GPUS_PER_NODE
        generation = [_node_of(placement, placement.generation_options(i)) for i in range(generation_workers)]
        assert not set(generation) & set(policy)
        assert all(placement.policy_options(r)["num_gpus"] == 1.0 for r in range(world))

        # the training group's and the refit group's store is on policy rank 0's node
        @ray.remote(num_cpus=0)
        def node_id() -> str:
            return ray.get_runtime_context().get_node_id()

        monkeypatch.setattr(cluster, "_node_ip", node_id)
        assert placement.node_ip(0) == policy[0]
    finally:
        placement.remove()


def test_node_major_order_and_a_block_split_over_nodes() -> None:
    # what PACK returned for 24 bundles on 3 x 8 GPUs (node of each bundle index)
    nodes = list("acccccccc" "aaabaaaa" "bbbbbbb")
    order = node_major_bundles(nodes, 24, 8)
    assert [nodes[i] for i in order] == list("a" * 8 + "c" * 8 + "b" * 8)
    assert sorted(order) == list(range(24))
    # a node with only 6 free GPUs: ranks 4-7 would span two nodes
    with pytest.raises(ConfigError, match=r"policy ranks 4-7 on more than one node .*cluster.gpus_per_node=4"):
        node_major_bundles(list("aaaaaabb"), 8, 4)


def test_checkpoint_paths_reach_the_workers_absolute(ray_cluster, tmp_path, monkeypatch) -> None:
    _, node_cwd = ray_cluster

    @ray.remote(num_cpus=0)
    class Rank:
        def save_checkpoint(self, path: str) -> str:
            Path(path).mkdir(parents=True, exist_ok=True)
            (Path(path) / f"shard-{os.getpid()}").write_text("weights")
            return os.getcwd()

        def load_checkpoint(self, path: str) -> None:
            assert (Path(path) / f"shard-{os.getpid()}").read_text() == "weights", path

    monkeypatch.chdir(tmp_path)
    workers = Workers.__new__(Workers)
    workers.policy = [Rank.remote() for _ in range(2)]
    workers.colocation = Colocation(False, policy=None, generators=None)
    assert ray.get(workers.policy[0].save_checkpoint.remote(str(tmp_path / "probe"))) == str(node_cwd)
    workers.save_checkpoint("run/checkpoints/.step_1.tmp/policy")  # relative, as the driver's CheckpointManager
    assert len(list((tmp_path / "run/checkpoints/.step_1.tmp/policy").glob("shard-*"))) == 2
    assert not (node_cwd / "run").exists()
    workers.load_checkpoint("run/checkpoints/.step_1.tmp/policy")


def test_a_checkpoint_dir_the_ranks_cannot_see_is_a_config_error(ray_cluster, tmp_path, monkeypatch) -> None:
    cfg = _config(ray_cluster, NODES, 24)
    placement = Placement(cfg)
    try:
        check_shared_dir(placement, tmp_path / "shared", "logger.log_dir")  # one machine: one filesystem
        driver_node = ray.get_runtime_context().get_node_id()

        @ray.remote(num_cpus=0)
        def node_local_fs(path: str) -> bool:  # only the driver's node mounts the directory
            return ray.get_runtime_context().get_node_id() == driver_node and os.path.exists(path)

        monkeypatch.setattr(cluster, "_path_exists", node_local_fs)
        elsewhere = [r for r in range(24) if _node_of(placement, placement.policy_options(r)) != driver_node]
        with pytest.raises(ConfigError, match=rf"logger.log_dir: .* policy rank\(s\) {re.escape(str(elsewhere))}: .*filesystem"):
            check_shared_dir(placement, tmp_path / "local", "logger.log_dir")
        assert not list((tmp_path / "local").iterdir())  # the marker is gone
    finally:
        placement.remove()


def test_a_placement_the_cluster_never_grants_stops_naming_the_keys(ray_cluster, monkeypatch) -> None:
    monkeypatch.setattr(cluster, "PLACEMENT_TIMEOUT_S", 2.0)
    cfg = _config(ray_cluster, NODES + 1, (NODES + 1) * GPUS_PER_NODE)  # 32 GPUs on a 24-GPU cluster
    raised: list[BaseException] = []

    def place() -> None:
        try:
            Placement(cfg)
        except BaseException as exc:  # handed to the test's thread
            raised.append(exc)

    thread = threading.Thread(target=place, daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert not thread.is_alive(), "Placement still waits for GPUs the cluster does not have"
    assert isinstance(raised[0], ConfigError)
    assert "cluster.num_nodes=4 x cluster.gpus_per_node=8, cluster.train_world_size=32" in str(raised[0])
    assert "the Ray cluster has 24 GPU(s)" in str(raised[0])
    states = [pg["state"] for pg in placement_group_table().values()]
    assert "PENDING" not in states  # removed, not left to grab GPUs later
