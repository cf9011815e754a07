"""A local run listens on 127.0.0.1 only (issue 17): Ray's GCS, raylet, driver and worker servers, and the
TCPStore + gloo sockets of a process group, listed from the kernel's socket table for the run's processes. Its
groups' stores listen on ports picked as they bind, not found free ahead."""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
import tempfile

import psutil
import ray

from grpo_app.cluster import start_ray
from grpo_app.config import load_config


@ray.remote(num_cpus=0)
class GroupHolder:
    """One rank of a gloo group over the app's TCPStore, kept alive while the test lists sockets."""

    def join(self, host: str) -> tuple[int, int]:
        """(pid, the store's port)"""
        import torch

        from grpo_app.refit import RefitGroup, tcp_store

        store = tcp_store(host, 0, 1, True)
        self.group = RefitGroup(store, rank=0, world_size=1)
        tensor = torch.ones(2)
        self.group.group.allreduce([tensor]).wait()
        return os.getpid(), store.port


def _run_processes() -> set[int]:
    """This driver, every process started for its Ray session, and their children."""
    session = ray._private.worker._global_node.get_session_dir_path()
    pids = {os.getpid()}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(session in arg for arg in proc.info["cmdline"] or []):
                pids |= {proc.pid, *(c.pid for c in proc.children(recursive=True))}
        except psutil.Error:
            continue
    return pids | {c.pid for c in psutil.Process().children(recursive=True)}


def test_local_run_listens_on_loopback_only():
    cfg = load_config(None, ["cluster.num_cpus=1"])
    start_ray(cfg)
    try:
        holder = GroupHolder.remote()
        worker_pid, port = ray.get(holder.join.remote("127.0.0.1"))
        pids = _run_processes()
        assert worker_pid in pids
        listening = [(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in pids]
        names = {psutil.Process(pid).name() for _, _, pid in listening}
        assert {"gcs_server", "raylet"} <= names and any(p == port for _, p, _ in listening)
        exposed = [(ip, p, psutil.Process(pid).name()) for ip, p, pid in listening
                   if not (ipaddress.ip_address(ip).is_loopback or ip.startswith("::ffff:127."))]
        assert not exposed, f"listening beyond loopback: {exposed}"
        assert len(listening) >= 5
    finally:
        ray.shutdown()


def test_a_local_run_starts_its_own_ray_where_another_cluster_is_announced(monkeypatch, caplog):
    """cluster.address unset means a local Ray, even with RAY_ADDRESS set (or a `ray start` cluster on the
    machine): ray.init() would try to join it (here: nothing listens) and refuses num_cpus if it could."""
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    with caplog.at_level("WARNING", logger="grpo_app.cluster"):
        start_ray(load_config(None, ["cluster.num_cpus=1"]))
    try:
        assert ray.is_initialized() and ray.cluster_resources()["CPU"] == 1
        assert "RAY_ADDRESS=127.0.0.1:1 is set but cluster.address is not" in caplog.text
    finally:
        ray.shutdown()


@ray.remote(num_cpus=0)
def _worker_log_level() -> int:
    import logging

    from grpo_app.worker_logging import setup_worker_logging

    setup_worker_logging()
    return logging.getLogger().getEffectiveLevel()


def test_workers_log_at_the_drivers_level():
    """--log-level WARNING quietened the driver only: every worker went on logging at INFO."""
    import logging

    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.WARNING)
    try:
        start_ray(load_config(None, ["cluster.num_cpus=1"]))
        assert ray.get(_worker_log_level.remote()) == logging.WARNING
    finally:
        root.setLevel(before)
        ray.shutdown()


def test_a_reward_worker_imports_neither_torch_nor_transformers():
    """Their imports were ~4 of a reward worker's 6 CPU-seconds of start, in every trainer start, and scoring with
    a function needs neither (the `reward_model` environment imports them as it is built). A fresh interpreter, as
    the worker Ray starts: the actor's module, then the built-in `math` environment scoring a completion."""
    code = ("import sys\n"
            "from grpo_app.reward_worker import RewardWorker\n"
            "from rl_core.interfaces import RewardRequest\n"
            "from rollout.environments import create_environment\n"
            "env = create_environment('math', num_workers=1)\n"
            "[result] = env.score([RewardRequest(prompt='1+1?', completion='\\\\boxed{2}', metadata={'answer': '2'})])\n"
            "env.close()\n"
            "print(result.reward, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-2:] == ["1.0", "[]"], proc.stdout


def _start_and_refit_with_every_free_port_taken(rank: int, world_size: int, cfg) -> int:
    """Workers(cfg) on a local Ray (this spawned process is the driver) while any port found free ahead (the driver
    did, with rl_core.distributed's free_port, since removed) is one this process already listens on; then a
    refit. Returns the bytes refit sent."""
    import socket

    import rl_core.distributed
    from grpo_app import cluster

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    busy = taken.getsockname()[1]
    rl_core.distributed.free_port = lambda host="127.0.0.1": busy
    if hasattr(cluster, "free_port"):  # where a module took its own name for it
        cluster.free_port = rl_core.distributed.free_port
    cluster.start_ray(cfg)
    try:
        workers = cluster.Workers(cfg)
        try:
            return workers.refit()
        finally:
            workers.shutdown()
    finally:
        cluster.stop_ray()
        taken.close()


def test_the_run_forms_its_groups_on_ports_its_stores_pick_as_they_listen(tmp_path, monkeypatch):
    """The training group's and the refit group's stores listen on ports the OS picks as policy rank 0 binds them,
    sent to the other members: a port found free by the driver and bound later by rank 0 can be taken in between
    (two runs or test processes on one machine: "Address already in use", which failed CI in the test harness).
    Here every port found free ahead is already taken; two policy ranks and a generation worker still form both
    groups, and a refit moves the weights."""
    from grpo_app.preflight import preflight
    from rl_core.testing.distributed import run_distributed

    monkeypatch.setenv("RAY_TMPDIR", tempfile.gettempdir())
    cfg = preflight(load_config(None, ["cluster.train_world_size=2", "generation.num_workers=1",
                                       f"logger.log_dir={tmp_path / 'run'}"]))
    (sent,) = run_distributed(_start_and_refit_with_every_free_port_taken, world_size=1, args=(cfg,),
                              start_method="spawn", timeout=300)
    assert sent > 0
