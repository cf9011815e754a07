"""Reward-function limits (issue 17): a hanging function costs one time limit per batch, in-process
scoring (num_workers=0) keeps the limit, too many failures stop the run, and the worker sandbox holds:
memory limit, writes only to its scratch directory, no network (rollout._sandbox says what holds where)."""

from __future__ import annotations

import logging
import socket
import sys
import textwrap
import time

import pytest

from rl_core.interfaces import RewardRequest, RewardResult
from rollout.environments import RewardFailureError, check_reward_failures, create_environment

PROBES = textwrap.dedent('''
    import os, socket, subprocess, sys, time

    def hang(*, prompt, completion, metadata):
        time.sleep(600)

    def hang_if_asked(*, prompt, completion, metadata):
        if metadata.get("hang"):
            time.sleep(600)
        return 1.0

    def probe(*, prompt, completion, metadata):
        mode = metadata["mode"]
        if mode == "write_outside":
            with open(metadata["path"], "w") as f:
                f.write("escaped")
        elif mode == "write_scratch":
            with open("inside.txt", "w") as f:
                f.write("ok")
            return {"reward": 1.0 if os.getcwd() != metadata["launch_dir"] else 0.5}
        elif mode == "connect":
            socket.create_connection(("127.0.0.1", metadata["port"]), timeout=2).close()
        elif mode == "connect_in_child":  # a fresh interpreter: no audit hook, only the kernel's layers
            code = f"import socket; socket.create_connection(('127.0.0.1', {metadata['port']}), timeout=2)"
            return float(subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0)
        elif mode == "allocate":
            return float(len(bytearray(metadata["mb"] * 2**20)) > 0)
        return 1.0
''')


@pytest.fixture()
def probes(tmp_path, monkeypatch):
    (tmp_path / "reward_probes.py").write_text(PROBES)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit sys.path
    return tmp_path


WORKER_START_S = 10.0  # a replacement worker's start (spawn, imports), generous for 2 shared cores


def req(**metadata) -> RewardRequest:
    return RewardRequest(prompt="p", completion="c", metadata=metadata)


@pytest.mark.parametrize("num_workers", [2, 0])
def test_hanging_function_costs_one_time_limit_per_batch(probes, num_workers):
    """8 calls that all hang, limit 1 s: the batch ends once as many calls overran as there are workers (2 at
    ~1 s; one worker: its first overrun is replaced, the second ends the batch), where per call it would take
    4-8 s; with num_workers=0 the call still runs in a subprocess, so the limit holds there too."""
    env = create_environment("function", fn="reward_probes:hang", num_workers=num_workers, timeout_s=1.0)
    try:
        start = time.monotonic()
        results = env.score([req()] * 8)
        elapsed = time.monotonic() - start
        assert elapsed < (2.5 if num_workers == 2 else 2.5 + WORKER_START_S), elapsed
        assert all(r.reward == 0.0 and "exceeded 1.0 s" in r.error for r in results)
        assert env.last_metrics["reward/timeouts"] == 8
    finally:
        env.close()


def test_one_hanging_call_costs_that_call_alone(probes):
    """A reward that hangs on one pathological completion (as math parsers can): that call is a timeout, its
    worker is replaced, and the other 7 calls of the batch are scored (before, they all failed with it)."""
    env = create_environment("function", fn="reward_probes:hang_if_asked", num_workers=2, timeout_s=1.0)
    try:
        results = env.score([req(hang=i == 2) for i in range(8)])
        assert [r.reward for r in results] == [1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
        assert "reward call 2 of this batch exceeded 1.0 s; its worker was replaced" in results[2].error
        assert env.last_metrics["reward/timeouts"] == 1
        assert [r.reward for r in env.score([req()] * 4)] == [1.0] * 4  # the replacement scores the next batch
    finally:
        env.close()


def test_failed_share_stops_the_run(caplog):
    ok, bad = RewardResult(reward=1.0), RewardResult(reward=0.0, error="error: TypeError: returned None")
    with caplog.at_level(logging.WARNING, logger="rollout.environments.base"):
        check_reward_failures([ok, bad, bad], 1.0, "env.max_failed_reward_fraction")  # default: only when all fail
    # below the bound: said in the driver's log (it was only in the reward worker's)
    assert ("2 of 3 reward calls failed and score 0 (the run stops at env.max_failed_reward_fraction=1.0); first: "
            "error: TypeError: returned None") in caplog.text
    with pytest.raises(RewardFailureError, match=r"3 of 3 reward calls failed .*TypeError: returned None"):
        check_reward_failures([bad] * 3, 1.0, "env.max_failed_reward_fraction")
    with pytest.raises(RewardFailureError, match=r"2 of 3 .*env.max_failed_reward_fraction=0.5"):
        check_reward_failures([ok, bad, bad], 0.5, "env.max_failed_reward_fraction")
    check_reward_failures([ok] * 3, 0.0, "env.max_failed_reward_fraction")


def test_sandbox_scratch_dir_memory_and_network(probes, tmp_path):
    outside = tmp_path / "escape.txt"
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    env = create_environment("function", fn="reward_probes:probe", num_workers=1, timeout_s=20.0,
                             memory_limit_mb=512)
    try:
        layers = env.pool.sandbox
        results = env.score([req(mode="write_scratch", launch_dir=str(probes.parent)),
                             req(mode="allocate", mb=1024), req(mode="allocate", mb=64),
                             req(mode="connect", port=port)])
        assert results[0].reward == 1.0  # writes to its own working directory, which is not the launch dir
        assert "MemoryError" in results[1].error and results[2].reward == 1.0
        assert "network access is disabled" in results[3].error
        if sys.platform.startswith("linux"):
            assert {"rlimit-as", "scratch-cwd", "audit-no-inet-sockets"} <= set(layers)
        if "landlock-writes" not in layers:
            pytest.skip(f"this kernel has no Landlock: writes outside the scratch dir are not refused ({layers})")
        wrote = env.score([req(mode="write_outside", path=str(outside))])
        assert "PermissionError" in wrote[0].error and not outside.exists()
        if not {"netns", "userns-netns", "landlock-tcp"} & set(layers):
            pytest.skip(f"no network namespace or Landlock TCP rules here ({layers})")
        child = env.score([req(mode="connect_in_child", port=port)])
        assert child[0].reward == 0.0  # a child process inherits the namespace / Landlock domain
    finally:
        env.close()
        server.close()
