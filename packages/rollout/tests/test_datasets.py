"""Prompt datasets from local JSONL / Parquet, checked against the tokenizer applied by hand."""

from __future__ import annotations

import copy
import json
import logging

import pytest

from rollout.datasets import build_examples, load_prompt_dataset
from rollout.environments import toy_prompts

ROWS = [{"prompt": "What is 1/2 + 0?", "answer": "1/2"}, {"prompt": "2+2=", "answer": "4"}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_give_the_same_examples(tmp_path, tokenizer):
    import datasets

    jsonl = write_jsonl(tmp_path / "p.jsonl", ROWS)
    parquet = tmp_path / "p.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(str(parquet))
    from_jsonl = load_prompt_dataset(jsonl, tokenizer)
    assert from_jsonl == load_prompt_dataset(parquet, tokenizer)
    for ex, row in zip(from_jsonl, ROWS):
        assert ex.prompt == row["prompt"]
        assert ex.prompt_token_ids == [tokenizer.bos_token_id] + tokenizer.encode(row["prompt"], add_special_tokens=False)
        assert ex.metadata == {"answer": row["answer"]}
    assert len(load_prompt_dataset(jsonl, tokenizer, limit=1)) == 1


def test_json_file_holding_one_array_is_read(tmp_path, tokenizer):
    """`json.dump(rows)` writes one JSON array: a `.json` file of it reads like JSONL, and a bad element is
    named by its position."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps(ROWS, indent=2))
    examples = load_prompt_dataset(path, tokenizer)
    for ex, row in zip(examples, ROWS, strict=True):
        assert ex.prompt == row["prompt"]
        assert ex.prompt_token_ids == [tokenizer.bos_token_id] + tokenizer.encode(row["prompt"], add_special_tokens=False)
        assert ex.metadata == {"answer": row["answer"]}
    path.write_text(json.dumps([ROWS[0], {"question": "b"}]))
    with pytest.raises(ValueError, match=r"p\.json: record 2: no 'prompt' field \(found \['question'\]\)"):
        load_prompt_dataset(path, tokenizer)


def test_chat_template_renders_user_turn_and_system_prompt(tmp_path, tokenizer):
    rows = ROWS + [{"prompt": [{"role": "user", "content": "hi"}], "answer": "x"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = load_prompt_dataset(path, tokenizer, apply_chat_template=True, system_prompt="Be brief.")
    assert examples[0].prompt == "system: Be brief.\nuser: What is 1/2 + 0?\nassistant: "
    assert examples[2].prompt == "system: Be brief.\nuser: hi\nassistant: "
    assert examples[0].prompt_token_ids == tokenizer.encode(examples[0].prompt, add_special_tokens=False)
    # the messages the prompt was rendered from, for environments that render it their own way
    assert examples[2].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert examples[0].messages[1] == {"role": "user", "content": "What is 1/2 + 0?"}


def test_a_prompt_with_its_own_system_message_keeps_it_with_a_warning(tmp_path, tokenizer, caplog):
    """verl's prepared data often starts with a system turn: it stays, and env.system_prompt (silently unused on
    those prompts before) is said to apply to the others only."""
    rows = [{"prompt": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}]}, {"prompt": "yo"}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level(logging.WARNING, logger="rollout.datasets"):
        examples = load_prompt_dataset(path, tokenizer, apply_chat_template=True, system_prompt="Be brief.")
    assert [e.prompt for e in examples] == ["system: Mine.\nuser: hi\nassistant: ",
                                            "system: Be brief.\nuser: yo\nassistant: "]
    assert ("1 of 2 prompts start with a system message of their own, which stays: the system prompt (the "
            "trainer's env.system_prompt) applies to the others only") in caplog.text


def test_chat_prompts_ending_with_the_answer_or_refused_by_the_template_are_errors(tmp_path, tokenizer):
    """SFT data ending with the assistant's answer rendered 'user: ...\nassistant: 2\nassistant: ' (the answer in
    the prompt, exit 0); a template's raise_exception was a jinja traceback, exit 1."""
    path = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": [{"role": "user", "content": "1+1?"},
                                                            {"role": "assistant", "content": "2"}]}])
    with pytest.raises(ValueError, match=r"record 1, field 'prompt': the last message is the assistant's"):
        load_prompt_dataset(path, tokenizer, apply_chat_template=True)
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
    with pytest.raises(ValueError, match=r"chat template .* failed on these messages: TemplateError: no system role"):
        load_prompt_dataset(write_jsonl(tmp_path / "ok.jsonl", ROWS), strict, apply_chat_template=True,
                            system_prompt="Be brief.")


def test_a_non_utf8_byte_or_a_bom_is_named_with_its_line_and_the_fix(tmp_path, tokenizer):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not UTF-8 text \(byte b'\\xe9' at column 16\); save "
                                         r"the file as UTF-8"):
        load_prompt_dataset(path, tokenizer)
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=r"starts with a UTF-8 byte order mark \(BOM\); save it as UTF-8 without BOM"):
        load_prompt_dataset(path, tokenizer)


def test_a_field_holding_text_and_numbers_is_refused_not_converted(tmp_path, tokenizer):
    """datasets reads a JSONL column as one type: the answer "007" reached the reward as the int 7."""
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"prompt": "a", "answer": "007"}, {"prompt": "b", "answer": 5}])
    with pytest.raises(ValueError, match=r"mixed\.jsonl: line 2: field 'answer' is a number \(5\), but text in line 1: "
                                         r"a column is read as one type"):
        load_prompt_dataset(path, tokenizer)
    array = tmp_path / "mixed.json"
    array.write_text(json.dumps([{"prompt": "a", "answer": 5}, {"prompt": "b", "answer": "007"}]))
    with pytest.raises(ValueError, match=r"mixed\.json: record 2: field 'answer' is text \('007'\), but a number in "
                                         r"record 1"):
        load_prompt_dataset(array, tokenizer)
    same = write_jsonl(tmp_path / "same.jsonl", [{"prompt": "a", "answer": "007"}, {"prompt": "b", "answer": "5"}])
    assert [e.metadata["answer"] for e in load_prompt_dataset(same, tokenizer)] == ["007", "5"]


def test_malformed_jsonl_line_names_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b", oops}\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        load_prompt_dataset(path, tokenizer)
    path.write_text('{"prompt": "a"}\n{"question": "b"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: no 'prompt' field \(found \['question'\]\)"):
        load_prompt_dataset(path, tokenizer)
    path.write_text('{"answer": "1", "question": "b"}\n')  # the hint names the trainer's key and a candidate
    with pytest.raises(ValueError, match=r"no 'prompt' field \(found \['answer', 'question'\]\); set prompt_key "
                                         r"\(the trainer's env.prompt_key\) to the field that holds the prompt, e.g. "
                                         r"env.prompt_key=question$"):
        load_prompt_dataset(path, tokenizer)
    path.write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object"):
        load_prompt_dataset(path, tokenizer)
    path.write_text('{"prompt": "a"}\n{"prompt": "  "}\n')  # it trained on BOS alone, without a word
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: field 'prompt' is an empty string '  '; every prompt needs text"):
        load_prompt_dataset(path, tokenizer)
    # valid JSON, one object over several lines (json.dump(obj, indent=2)): not "line 1: malformed JSON"
    path = tmp_path / "wrapped.json"
    path.write_text(json.dumps({"data": ROWS}, indent=2))
    with pytest.raises(ValueError, match=r"wrapped\.json is one JSON dict with keys \['data'\], not a record per line "
                                         r"\(JSONL\) nor a JSON array of records; write the records themselves"):
        load_prompt_dataset(path, tokenizer)


def test_missing_file_and_unknown_suffix(tmp_path, tokenizer):
    with pytest.raises(ValueError, match=r"does not exist \(expected a local .jsonl, .json or .parquet file, a "
                                         r"directory written by datasets' save_to_disk, or a Hugging Face Hub"):
        load_prompt_dataset(tmp_path / "none.jsonl", tokenizer)
    (tmp_path / "p.csv").write_text("prompt\na\n")
    with pytest.raises(ValueError, match="unsupported suffix '.csv'"):
        load_prompt_dataset(tmp_path / "p.csv", tokenizer)


def test_empty_parquet_and_a_directory_are_named(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match=r"empty\.parquet holds no records"):
        load_prompt_dataset(tmp_path / "empty.parquet", tokenizer)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")  # pyarrow's message named no file
    with pytest.raises(ValueError, match=r"bad\.parquet is not a readable Parquet file \(ArrowInvalid: "):
        load_prompt_dataset(tmp_path / "bad.parquet", tokenizer)
    (tmp_path / "other").mkdir()
    with pytest.raises(ValueError, match=r"other is a directory; expected a local \.jsonl or \.parquet file or a "
                                         r"directory that datasets' save_to_disk wrote"):
        load_prompt_dataset(tmp_path / "other", tokenizer)


def test_a_dataset_saved_with_save_to_disk_loads_as_its_jsonl_does(tmp_path, tokenizer):
    """A `datasets` Dataset saved with save_to_disk gives the examples of the same records as JSONL; a saved
    DatasetDict names its split directories; an empty one and a missing prompt column are named."""
    import datasets

    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "saved"))
    assert load_prompt_dataset(tmp_path / "saved", tokenizer) == load_prompt_dataset(jsonl, tokenizer)
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match=rf"dict is a saved DatasetDict; point at one of its splits: {tmp_path}/dict/train"):
        load_prompt_dataset(tmp_path / "dict", tokenizer)
    assert load_prompt_dataset(tmp_path / "dict/train", tokenizer) == load_prompt_dataset(jsonl, tokenizer)
    datasets.Dataset.from_list([{"question": "q"}]).save_to_disk(str(tmp_path / "other-key"))
    with pytest.raises(ValueError, match=r"no 'prompt' column \(found \['question'\]\).*env.prompt_key=question"):
        load_prompt_dataset(tmp_path / "other-key", tokenizer)
    datasets.Dataset.from_dict({"prompt": []}).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"empty holds no records"):
        load_prompt_dataset(tmp_path / "empty", tokenizer)


def test_prompts_the_tokenizer_cannot_read_back_are_counted_in_one_warning(tokenizer, caplog):
    rows = [{"prompt": "café au lait"}, {"prompt": "2+2="}, {"prompt": "naïve"}]
    with caplog.at_level(logging.WARNING, logger="rollout.datasets"):
        build_examples(rows, tokenizer)
    assert len(caplog.records) == 1 and caplog.records[0].getMessage().startswith(
        "2 of 3 prompts lose characters in the tokenizer (record 1: 'café au lait' reads back as 'caf<unk><unk> au lait')")  # é: two UTF-8 bytes
    assert "policy.model_name" in caplog.text
    caplog.clear()
    build_examples(toy_prompts("repeat_char", 3) + ROWS, tokenizer)
    assert not caplog.records


def test_toy_prompts_become_examples_with_flat_metadata(tokenizer):
    examples = build_examples(toy_prompts("repeat_char", 3), tokenizer)
    assert [e.metadata["target"] for e in examples] == [e.prompt[-1] for e in examples]


def test_prompts_encoded_together_are_each_prompt_encoded_alone(tokenizer):
    """build_examples encodes the whole list in one call: the ids are those of one `encode` per prompt, in order,
    with and without the chat template (whose own special tokens stand instead of the BOS)."""
    records = toy_prompts("copy_digits", 150) + toy_prompts("repeat_char", 150) + ROWS
    for chat in (False, True):
        examples = build_examples(records, tokenizer, apply_chat_template=chat)
        alone = [tokenizer.encode(e.prompt, add_special_tokens=False) for e in examples]
        assert [e.prompt_token_ids for e in examples] == (alone if chat else [[tokenizer.bos_token_id] + a for a in alone])
        assert [e.metadata for e in examples][-2:] == [{"answer": "1/2"}, {"answer": "4"}]
    assert build_examples([], tokenizer) == []


def test_answer_key_reads_verls_nested_ground_truth_from_parquet(tmp_path, tokenizer):
    """verl's prepared data (chat-message prompts, the answer in a `reward_model` struct column) trains with
    env.answer_key=reward_model.ground_truth: the math environment's metadata 'answer' is that field."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rollout.rewards.math_answer import math_reward

    rows = [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": "2+2?"}],
             "reward_model": {"style": "rule", "ground_truth": "4"}},
            {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "3*3?"}],
             "reward_model": {"style": "rule", "ground_truth": "9"}}]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    examples = load_prompt_dataset(path, tokenizer, apply_chat_template=True, answer_key="reward_model.ground_truth")
    assert [e.metadata["answer"] for e in examples] == ["4", "9"]
    assert examples[0].metadata["reward_model"] == {"style": "rule", "ground_truth": "4"}  # the rest stays
    assert math_reward(prompt=examples[1].prompt, completion="so \\boxed{9}", metadata=examples[1].metadata)["reward"] == 1.0
    with pytest.raises(ValueError, match=r"train.parquet: record 1: no field 'reward_model.answer' \(answer_key\): "
                                         r"reward_model holds \['ground_truth', 'style'\]"):
        load_prompt_dataset(path, tokenizer, apply_chat_template=True, answer_key="reward_model.answer")
