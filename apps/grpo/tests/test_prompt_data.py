"""env.train_data / env.val_data as a Hugging Face Hub dataset: a directory in the Hub's layout (built here) or a
name, with env.{train,val}_split and env.{train,val}_subset; every mistake fails before Ray starts. Offline: no test
here reaches the Hub."""

from __future__ import annotations

import logging

import pytest
import ray
import yaml

from grpo_app.config import load_config
from grpo_app.main import main
from grpo_app.preflight import preflight
from rl_core.config import ConfigError
from rl_core.testing.tiny_models import cached_tiny_checkpoint

SUBSETS, SPLITS = ("main", "socratic"), ("train", "test")


@pytest.fixture(autouse=True)
def _no_hub(monkeypatch):
    import datasets
    import huggingface_hub

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # for any subprocess; this one read them at import
        monkeypatch.setenv(name, "1")
    for module in (datasets.config, huggingface_hub.constants):
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)


def gsm8k_rows(subset: str, split: str) -> list[dict[str, str]]:
    """GSM8K's columns: the question, and the worked answer ending in '#### <number>'."""
    return [{"question": f"({subset} {split}) Natalia sold {n} clips in April and half as many in May. How many?",
             "answer": f"In May she sold {n}/2 = {n // 2}. {n}+{n // 2} = {n + n // 2}\n#### {n + n // 2}"}
            for n in (48, 20, 6)]


@pytest.fixture
def gsm8k(tmp_path):
    """What `hf download --repo-type dataset openai/gsm8k --local-dir gsm8k` writes: a parquet file per subset and
    split, and a README whose YAML header declares the subsets."""
    import datasets

    root = tmp_path / "gsm8k"
    for subset in SUBSETS:
        for split in SPLITS:
            rows = datasets.Dataset.from_list(gsm8k_rows(subset, split))
            rows.to_parquet(str(root / subset / f"{split}-00000-of-00001.parquet"))
    configs = [{"config_name": subset, "data_files": [{"split": split, "path": f"{subset}/{split}-*"} for split in SPLITS]}
               for subset in SUBSETS]
    (root / "README.md").write_text(f"---\n{yaml.safe_dump({'configs': configs})}---\n")
    return root


def fails_before_ray(caplog, *overrides: str) -> str:
    """main()'s error log for a run that must stop with exit code 2 before Ray starts."""
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="grpo"):
        assert main(["logger.tensorboard=false", *overrides]) == 2
    assert not ray.is_initialized()
    return caplog.text


def test_gsm8k_trains_on_its_train_split_and_validates_on_test(gsm8k):
    """The downloaded repository through preflight and build.load_prompts: the question is the prompt, the whole
    worked answer the metadata 'answer', each from the split and subset asked for."""
    from grpo_app.build import load_inputs

    cfg = preflight(load_config(None, [f"policy.model_name={cached_tiny_checkpoint('qwen2')}", "env.name=math",
                                       f"env.train_data={gsm8k}", f"env.val_data={gsm8k}", "env.train_subset=main",
                                       "env.val_subset=socratic", "env.prompt_key=question", "grpo.num_val_prompts=8"]))
    inputs = load_inputs(cfg)
    expected_train = sorted((r["question"], r["answer"]) for r in gsm8k_rows("main", "train"))
    assert sorted((e.prompt, e.metadata["answer"]) for e in inputs.train.items) == expected_train
    assert [(e.prompt, e.metadata["answer"]) for e in inputs.val] == [
        (r["question"], r["answer"]) for r in gsm8k_rows("socratic", "test")]
    assert inputs.val[0].metadata["answer"].endswith("#### 72")


def test_a_missing_split_or_subset_lists_the_ones_there_are(caplog, gsm8k):
    text = fails_before_ray(caplog, "env.name=math", f"env.train_data={gsm8k}", f"env.val_data={gsm8k}",
                            "env.train_subset=main", "env.val_subset=main", "env.val_split=validation")
    assert (f"env.val_data='{gsm8k}' (env.val_split='validation', env.val_subset='main'): prompt dataset {gsm8k}, "
            "subset 'main', has no split 'validation'; choose the split among ['train', 'test']") in text
    text = fails_before_ray(caplog, "env.name=math", f"env.train_data={gsm8k}", f"env.val_data={gsm8k}")
    assert (f"env.train_data='{gsm8k}' (env.train_split='train', env.train_subset=None): prompt dataset {gsm8k} has "
            "several subsets, ['main', 'socratic'], and none is chosen; choose the subset") in text


def test_a_hub_name_without_the_hub_says_how_to_download_it(caplog, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./openai/gsm8k here
    text = fails_before_ray(caplog, "env.name=math", "env.train_data=openai/gsm8k", "env.train_subset=main",
                            "grpo.val_every=0")
    assert ("env.train_data='openai/gsm8k' (env.train_split='train', env.train_subset='main'): prompt dataset "
            "'openai/gsm8k' is not a local file or directory, and the Hugging Face Hub could not be reached") in text
    assert ("`hf download --repo-type dataset openai/gsm8k --local-dir gsm8k` (huggingface-cli download before "
            "huggingface_hub 1.0), and point at that directory: gsm8k") in text


def test_a_missing_prompt_column_names_the_columns(caplog, gsm8k):
    text = fails_before_ray(caplog, "env.name=math", f"env.train_data={gsm8k}", "env.train_subset=main",
                            "grpo.val_every=0")
    assert (f"{gsm8k}: no 'prompt' column (found ['question', 'answer']); set prompt_key (the trainer's "
            "env.prompt_key) to the field that holds the prompt, e.g. env.prompt_key=question") in text


@pytest.mark.parametrize("override, reset", [("env.train_split=validation", "env.train_split=train"),
                                             ("env.train_subset=main", "env.train_subset=")])
def test_a_split_or_subset_set_for_a_single_file_is_refused(tmp_path, override, reset):
    """A file is one split, read whole: a split or subset set for it would be silently ignored."""
    data = tmp_path / "math.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=rf"^{key}='{value}' picks part of a Hugging Face Hub dataset, but "
                                          rf"env.train_data='{data}' is one file \(or save_to_disk directory\), read "
                                          rf"whole; set {reset} \(its default\)"):
        preflight(load_config(None, ["env.name=math", f"env.train_data={data}", "grpo.val_every=0", override]))
    # the val split's default, "test", is no error for a file
    cfg = preflight(load_config(None, ["env.name=math", f"env.train_data={data}", f"env.val_data={data}"]))
    assert (cfg.env.val_data, cfg.env.val_split) == (str(data), "test")


def test_a_train_set_smaller_than_a_step_is_warned_about(tmp_path, caplog):
    """3 prompts and num_prompts_per_step=8 trained each prompt several times a step without a word."""
    import json

    from grpo_app.build import load_inputs

    data = tmp_path / "three.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(3)))
    cfg = preflight(load_config(None, ["env.name=math", f"env.train_data={data}", "grpo.val_every=0",
                                       "grpo.num_prompts_per_step=8", "policy.train_global_batch_size=8"]))
    with caplog.at_level(logging.WARNING, logger="grpo_app.build"):
        load_inputs(cfg)
    assert "the train set has 3 prompts, fewer than grpo.num_prompts_per_step=8: every step repeats" in caplog.text
