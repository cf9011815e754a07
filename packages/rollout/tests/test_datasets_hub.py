"""Prompt datasets in the Hugging Face Hub's layout (a downloaded repository, or a name), built locally: nothing here
reaches the Hub, and nothing is written under ~/.cache."""

from __future__ import annotations

import json

import pytest

from rollout.datasets import is_hub_dataset, load_prompt_dataset

GSM8K_CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: socratic
  data_files:
  - split: train
    path: socratic/train-*
  - split: test
    path: socratic/test-*
---
# gsm8k, as `hf download --repo-type dataset openai/gsm8k` writes it
"""


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    """The Hub is unreachable (`datasets` and huggingface_hub read the variables at import: their flags too)."""
    import datasets
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def rows_of(subset: str, split: str) -> list[dict[str, str]]:
    return [{"question": f"{subset} {split} q{i}?", "answer": f"work {i} #### {i * 7}"} for i in range(3)]


def write_parquet(path, rows) -> None:
    import datasets

    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_list(rows).to_parquet(str(path))


@pytest.fixture
def gsm8k_dir(tmp_path):
    """GSM8K's repository: subsets main/ and socratic/, each with a train and a test split, declared in README.md."""
    for subset in ("main", "socratic"):
        for split in ("train", "test"):
            write_parquet(tmp_path / "gsm8k" / subset / f"{split}-00000-of-00001.parquet", rows_of(subset, split))
    (tmp_path / "gsm8k" / "README.md").write_text(GSM8K_CARD)
    return tmp_path / "gsm8k"


def questions_and_answers(examples) -> list[tuple[str, str]]:
    return [(e.prompt, e.metadata["answer"]) for e in examples]


@pytest.mark.parametrize("subset", ["main", "socratic"])
@pytest.mark.parametrize("split", ["train", "test"])
def test_each_subset_and_split_of_a_downloaded_gsm8k(gsm8k_dir, tokenizer, subset, split):
    examples = load_prompt_dataset(gsm8k_dir, tokenizer, split=split, subset=subset, prompt_key="question")
    assert questions_and_answers(examples) == [(r["question"], r["answer"]) for r in rows_of(subset, split)]
    assert examples[0].prompt_token_ids == [tokenizer.bos_token_id] + tokenizer.encode(
        rows_of(subset, split)[0]["question"], add_special_tokens=False)


def test_plain_data_directory_and_split_files_by_name(tmp_path, tokenizer):
    """No README: `data/train-*.parquet` and `test.jsonl` name their splits; the split defaults to train."""
    for split in ("train", "test"):
        write_parquet(tmp_path / "plain" / "data" / f"{split}-00000-of-00001.parquet", rows_of("plain", split))
        (tmp_path / "jsonl").mkdir(exist_ok=True)
        (tmp_path / "jsonl" / f"{split}.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in rows_of("jsonl", split)))
        for name in ("plain", "jsonl"):
            examples = load_prompt_dataset(tmp_path / name, tokenizer, split=split, prompt_key="question")
            assert questions_and_answers(examples) == [(r["question"], r["answer"]) for r in rows_of(name, split)]
    default = load_prompt_dataset(str(tmp_path / "plain"), tokenizer, prompt_key="question")
    assert [e.prompt for e in default] == [r["question"] for r in rows_of("plain", "train")]


def test_rows_go_through_the_file_path_unchanged(tmp_path, tokenizer):
    """Chat messages, a dotted answer_key, the system prompt and limit give what the same rows in one file give."""
    rows = [{"messages": [{"role": "user", "content": f"{i}+{i}?"}], "reward_model": {"ground_truth": str(2 * i)}}
            for i in range(4)]
    write_parquet(tmp_path / "verl" / "data" / "train-00000-of-00001.parquet", rows)
    write_parquet(tmp_path / "one.parquet", rows)
    options = {"prompt_key": "messages", "apply_chat_template": True, "system_prompt": "Be brief.",
               "answer_key": "reward_model.ground_truth", "limit": 3}
    from_hub_layout = load_prompt_dataset(tmp_path / "verl", tokenizer, **options)
    assert from_hub_layout == load_prompt_dataset(tmp_path / "one.parquet", tokenizer, **options)
    assert [e.metadata["answer"] for e in from_hub_layout] == ["0", "2", "4"]
    assert from_hub_layout[1].prompt == "system: Be brief.\nuser: 1+1?\nassistant: "


def test_a_missing_split_lists_the_splits(gsm8k_dir, tmp_path, tokenizer):
    with pytest.raises(ValueError, match=rf"^prompt dataset {gsm8k_dir}, subset 'main', has no split 'validation'; "
                                         r"choose the split among \['train', 'test'\]$"):
        load_prompt_dataset(gsm8k_dir, tokenizer, split="validation", subset="main", prompt_key="question")
    write_parquet(tmp_path / "plain" / "data" / "train-00000-of-00001.parquet", rows_of("plain", "train"))
    with pytest.raises(ValueError, match=r"plain has no split 'test'; choose the split among \['train'\]$"):
        load_prompt_dataset(tmp_path / "plain", tokenizer, split="test", prompt_key="question")


def test_several_subsets_and_none_chosen_lists_them(gsm8k_dir, tokenizer):
    with pytest.raises(ValueError, match=rf"^prompt dataset {gsm8k_dir} has several subsets, \['main', 'socratic'\], "
                                         r"and none is chosen; choose the subset$"):
        load_prompt_dataset(gsm8k_dir, tokenizer, prompt_key="question")
    with pytest.raises(ValueError, match=r"gsm8k has no subset 'mian'; choose the subset among \['main', 'socratic'\]$"):
        load_prompt_dataset(gsm8k_dir, tokenizer, subset="mian", prompt_key="question")


def test_a_missing_prompt_column_names_the_columns(gsm8k_dir, tokenizer):
    with pytest.raises(ValueError, match=r"gsm8k: no 'prompt' column \(found \['question', 'answer'\]\); set "
                                         r"prompt_key \(the trainer's env.prompt_key\) to the field that holds the "
                                         r"prompt, e.g. env.prompt_key=question$"):
        load_prompt_dataset(gsm8k_dir, tokenizer, subset="main")


def test_an_empty_directory_is_named_a_directory_without_data_files(tmp_path, tokenizer):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty is a directory; expected .* or one in the Hugging Face Hub's layout "
                                         r"\(train.jsonl, data/train-00000-of-00001.parquet, ...\), and it holds no "
                                         r"data files"):
        load_prompt_dataset(tmp_path / "empty", tokenizer)


def test_a_hub_name_that_is_no_local_path_says_how_to_download_it(tmp_path, tokenizer, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^prompt dataset 'openai/gsm8k' is not a local file or directory, and the "
                                         r"Hugging Face Hub could not be reached \(.*\); download it where the Hub is "
                                         r"reachable, `hf download --repo-type dataset openai/gsm8k --local-dir "
                                         r"gsm8k` .*and point at that directory: gsm8k$"):
        load_prompt_dataset("openai/gsm8k", tokenizer, subset="main", prompt_key="question")
    # the name of a directory that is there is the directory; a path that names a file, or starts with ./, is no name
    write_parquet(tmp_path / "openai" / "gsm8k" / "data" / "train-00000-of-00001.parquet", rows_of("local", "train"))
    assert [e.prompt for e in load_prompt_dataset("openai/gsm8k", tokenizer, prompt_key="question")] == [
        r["question"] for r in rows_of("local", "train")]
    assert is_hub_dataset("openai/gsm8k") and is_hub_dataset("HuggingFaceH4/MATH-500")
    assert not any(map(is_hub_dataset, ["./openai/math", "runs/p.jsonl", "gsm8k", "/no/such/dir"]))
    with pytest.raises(ValueError, match="does not exist"):
        load_prompt_dataset("./openai/math", tokenizer)


def test_datasets_writes_nothing_outside_a_scratch_directory(gsm8k_dir, tmp_path, tokenizer, monkeypatch):
    """`datasets`' Arrow files and locks go to a temporary directory, removed once the rows are in memory: not to
    its cache (~/.cache/huggingface/datasets), for a Hub-layout directory and a single file alike."""
    import tempfile

    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n')
    write_parquet(tmp_path / "p.parquet", [{"prompt": "b"}])
    loaded = [load_prompt_dataset(gsm8k_dir, tokenizer, subset="main", prompt_key="question"),
              load_prompt_dataset(tmp_path / "p.jsonl", tokenizer), load_prompt_dataset(tmp_path / "p.parquet", tokenizer)]
    assert [len(examples) for examples in loaded] == [3, 1, 1]
    assert not (tmp_path / "hf-cache").exists() and list((tmp_path / "tmp").iterdir()) == []
