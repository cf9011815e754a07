"""Bad inputs fail before any worker starts, with a message naming the key or file and the fix."""

from __future__ import annotations

import logging

import ray

from grpo_app.main import main

SMALL = ["grpo.num_val_prompts=4", "logger.tensorboard=false"]


def run_main(caplog, *overrides: str) -> tuple[int, str]:
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="grpo"):
        code = main([*SMALL, *overrides])
    assert not ray.is_initialized(), "Ray was started before the inputs were checked"
    return code, caplog.text


def test_missing_model_path(caplog, tmp_path):
    code, text = run_main(caplog, f"policy.model_name={tmp_path / 'nope'}")
    assert code == 2 and "is not a local Hugging Face checkpoint directory" in text and "policy.model_name" in text


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
    code, text = run_main(caplog, "generation.backend=sglang")
    assert code == 2 and "generation.backend" in text and "'sglang' is not registered" in text


def test_missing_data_file(caplog):
    code, text = run_main(caplog, "env.train_data=/no/such/file.jsonl")
    assert code == 2 and "does not exist" in text
