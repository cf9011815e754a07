"""A refit while vLLM sleeps (the colocated GPU loop: sleep after generation, train, refit, wake) must reach the
weights the next generation uses. vLLM's sleep mode exists on GPUs only, so `vllm.LLM` is replaced here by a
model of its documented semantics; the real GPU check is still to be run (no vLLM on the GPU machines yet). The same
model checks which route a refit takes (tensors or a file) for each way vLLM places its worker."""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ALL_TAGS = ("weights", "kv_cache")


class SleepModeLLM:
    """vLLM sleep mode in miniature: level 1 keeps a host copy of the weights, level 2 keeps none; wake_up
    restores the tagged pools (the weights from the host copy); touching memory that sleeps fails, as
    unmapped device memory would."""

    def __init__(self, **kwargs) -> None:
        self.weights, self.host, self.awake = {"w": 0.0}, None, set(ALL_TAGS)
        self.model_config = types.SimpleNamespace(hf_text_config=types.SimpleNamespace(tie_word_embeddings=False))

    def sleep(self, level: int) -> None:
        self.host = dict(self.weights) if level == 1 else None
        self.weights, self.awake = {"w": math.nan}, set()

    def wake_up(self, tags=None) -> None:
        for tag in tags or ALL_TAGS:
            if tag == "weights" and tag not in self.awake and self.host is not None:
                self.weights = dict(self.host)
            self.awake.add(tag)

    def collective_rpc(self, method: str, kwargs: dict) -> None:
        if "weights" not in self.awake:
            raise RuntimeError("reload_weights into sleeping (unmapped) weight memory")
        self.refit_by = next(iter(kwargs))  # reload_weights(weights_iterator=...) or (weights_path=...)
        weights = (kwargs["weights_iterator"] if self.refit_by == "weights_iterator"
                   else load_file(Path(kwargs["weights_path"]) / "model.safetensors").items())
        self.weights.update({name: float(t) for name, t in weights})

    def reset_prefix_cache(self) -> None:
        pass


def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    platforms = types.SimpleNamespace(current_platform=types.SimpleNamespace(is_cpu=lambda: False))
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=SleepModeLLM))
    monkeypatch.setitem(sys.modules, "vllm.platforms", platforms)


@pytest.fixture
def backend(monkeypatch, tmp_path):
    fake_vllm(monkeypatch)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the worker in this process: tensors passed as they are
    from rollout.vllm_backend import VLLMGenerationBackend

    return VLLMGenerationBackend(str(tmp_path), enable_sleep_mode=True, refit="tensors")


@pytest.mark.parametrize("level", [1, 2])
def test_refit_while_asleep_is_what_the_next_generation_sees(backend, level):
    backend.sleep(level=level)
    backend.update_weights([("w", torch.tensor(1.5))])
    backend.wake()
    assert backend.llm.weights == {"w": 1.5} and backend.llm.awake == set(ALL_TAGS)


def test_sleep_and_wake_without_refit_keep_the_weights(backend):
    backend.update_weights([("w", torch.tensor(2.0))])  # awake: loaded directly
    backend.sleep(level=1)
    backend.wake()
    assert backend.llm.weights == {"w": 2.0} and backend.llm.awake == set(ALL_TAGS)


def test_wake_before_any_sleep_leaves_vllm_alone(backend, monkeypatch):
    """The colocated loop's first generation wakes an engine that never slept (grpo_app.colocation): vLLM
    would log 'Executor is not sleeping' on every rank."""
    monkeypatch.setattr(backend.llm, "wake_up", lambda tags=None: pytest.fail("wake_up of an awake engine"))
    backend.wake()
    assert backend.llm.awake == set(ALL_TAGS)


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_a_sample_vllm_aborted_is_an_error_not_a_length_cut_off(backend, monkeypatch, reason):
    """vLLM's finish reasons besides stop and length mean the sample is no completion (it was reported as a
    length cut-off, and trained on)."""
    sample = types.SimpleNamespace(index=0, token_ids=[5], logprobs=[{5: types.SimpleNamespace(logprob=-1.0)}],
                                   finish_reason=reason, stop_reason=None)
    monkeypatch.setattr(backend._vllm, "SamplingParams", lambda **kw: kw, raising=False)
    monkeypatch.setattr(backend.llm, "generate", lambda *a, **k: [types.SimpleNamespace(outputs=[sample])],
                        raising=False)
    from rl_core.interfaces import SamplingParams

    with pytest.raises(RuntimeError, match=f"finish_reason='{reason}'"):
        backend.generate([[1, 2]], SamplingParams(max_new_tokens=4))
    sample.finish_reason = "length"
    assert backend.generate([[1, 2]], SamplingParams(max_new_tokens=4))[0].finish_reason == "length"


def test_unseeded_sampling_across_external_launcher_ranks_is_refused(monkeypatch, tmp_path):
    """With external_launcher each TP rank samples for itself: without a seed their tokens would differ."""
    fake_vllm(monkeypatch)
    from rl_core.interfaces import SamplingParams
    from rollout.vllm_backend import VLLMGenerationBackend

    tp2 = VLLMGenerationBackend(str(tmp_path), tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    with pytest.raises(ValueError, match="needs SamplingParams.seed"):
        tp2.generate([[1, 2]], SamplingParams(max_new_tokens=4, temperature=1.0))


@pytest.mark.parametrize("multiprocessing, kwargs, refit_by", [
    ("0", {}, "weights_iterator"),
    ("0", {"tensor_parallel_size": 2, "distributed_executor_backend": "external_launcher"}, "weights_iterator"),
    (None, {}, "weights_path"),  # vLLM's default: the engine core in a process of its own
    ("1", {}, "weights_path"),
    ("0", {"tensor_parallel_size": 2}, "weights_path"),  # vLLM's own executor: workers in processes of their own
    ("0", {"pipeline_parallel_size": 2}, "weights_path"),
])
def test_a_refit_passes_tensors_only_where_vllms_worker_runs_in_this_process(monkeypatch, tmp_path, multiprocessing,
                                                                           kwargs, refit_by):
    """Across processes vLLM serialises rpc arguments: a generator of tensors cannot go there, so those refits go
    through a safetensors file (it failed for tensor_parallel_size=2 with the engine core in-process)."""
    fake_vllm(monkeypatch)
    if multiprocessing is None:
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    else:
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", multiprocessing)
    from rollout.vllm_backend import VLLMGenerationBackend

    backend = VLLMGenerationBackend(str(tmp_path), **kwargs)
    backend.update_weights(iter([("w", torch.tensor(1.5))]))
    assert backend.llm.refit_by == refit_by and backend.llm.weights == {"w": 1.5}
    if refit_by == "weights_iterator":
        return
    with pytest.raises(ValueError, match="refit='tensors' needs vLLM's worker in this process.*"
                                         "VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        VLLMGenerationBackend(str(tmp_path), refit="tensors", **kwargs)


def test_the_refit_file_goes_where_there_is_room_for_it(monkeypatch, tmp_path, caplog):
    """/dev/shm first (a container's is often 64 MB), then the temp directory; neither: an error with the sizes."""
    from rollout.vllm_backend import refit_dir_root

    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir(), disk.mkdir()
    free = {str(shm): 64 * 2**20, str(disk): 10 * 2**30}
    monkeypatch.setattr(shutil, "disk_usage", lambda path: types.SimpleNamespace(free=free[str(path)]))
    assert refit_dir_root(32 * 2**20, (str(shm), str(disk))) == str(shm)
    with caplog.at_level(logging.WARNING, logger="rollout.vllm_backend"):
        assert refit_dir_root(2**30, (str(shm), str(disk))) == str(disk)
    assert "0.06 GiB free, the weights need 1.00 GiB" in caplog.text and "--shm-size" in caplog.text
    with pytest.raises(ValueError, match=r"need 16.00 GiB of files, and no directory has room .*disk 10.00"):
        refit_dir_root(16 * 2**30, (str(shm), str(disk)))
    caplog.clear()
    assert refit_dir_root(2**30, (str(tmp_path / "absent"), str(disk))) == str(disk)  # no /dev/shm: no warning
    assert not caplog.text


REFIT_IN_A_PROCESS = """
import os, signal, sys, types
import torch
sys.modules["vllm"] = types.SimpleNamespace(LLM=lambda **kw: types.SimpleNamespace(
    collective_rpc=lambda *a, **k: None, reset_prefix_cache=lambda: None,
    model_config=types.SimpleNamespace(hf_text_config=types.SimpleNamespace(tie_word_embeddings=False))))
sys.modules["vllm.platforms"] = types.SimpleNamespace(current_platform=types.SimpleNamespace(is_cpu=lambda: False))
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # vLLM's default: the refit goes through a file
from rollout import vllm_backend
vllm_backend.REFIT_DIR_ROOTS = (sys.argv[1],)  # the test's directory, not /dev/shm
vllm_backend.refit_dir_root = lambda nbytes: sys.argv[1]
backend = vllm_backend.VLLMGenerationBackend(sys.argv[1])
backend.update_weights([("w", torch.ones(4))])
print(backend._refit_dir, flush=True)
if sys.argv[2] == "killed":
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_refit_file_does_not_outlive_its_process(tmp_path):
    """The refit's safetensors file (model-sized, in /dev/shm) goes when its process exits, and when the process was
    killed (SIGKILL, the OOM killer, ray.kill: no exit hook runs), the next refit on the machine removes it. Before,
    a __del__ removed it, which did not run at exit either: a tiny model's file was found in /dev/shm after its run."""
    def refit(how: str) -> tuple[int, Path]:
        proc = subprocess.run([sys.executable, "-c", REFIT_IN_A_PROCESS, str(tmp_path), how], capture_output=True,
                              text=True, timeout=120)
        return proc.returncode, Path(proc.stdout.strip().splitlines()[-1])

    code, exited = refit("exits")
    assert code == 0 and exited.parent == tmp_path and not exited.exists()
    code, killed = refit("killed")
    assert code == -signal.SIGKILL and (killed / "model.safetensors").is_file()
    code, survivor = refit("killed")  # its first refit removed the killed process's directory
    assert not killed.exists() and survivor.exists()


def test_only_refit_dirs_of_gone_processes_of_this_pid_namespace_are_removed(tmp_path):
    from rollout.vllm_backend import _pid_namespace, remove_stale_refit_dirs

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    ns = _pid_namespace()
    names = {"gone": f"rollout-refit-{ns}-{gone}-abc", "alive": f"rollout-refit-{ns}-{os.getpid()}-abc",
             "other_namespace": f"rollout-refit-{ns + 1}-{gone}-abc", "older_name": "rollout-refit-z4d14owv"}
    for name in names.values():
        (tmp_path / name).mkdir()
    assert remove_stale_refit_dirs(tmp_path) == [tmp_path / names["gone"]]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for k, n in names.items() if k != "gone")
