"""Prompt datasets: local JSONL (or a .json array) / Parquet files, or a directory `datasets`' save_to_disk wrote,
read through Hugging Face `datasets` (never downloaded).

Each row holds a prompt under `prompt_key` (a string, or a list of chat messages {"role", "content"});
every other column becomes the example's metadata (e.g. "answer" for the math environment; `answer_key` takes it
from another field, a dotted path into nested ones such as verl's `reward_model.ground_truth`). With
`apply_chat_template=True` the tokenizer's chat template renders the prompt (user turn, optional
system prompt, generation prompt appended). JSONL lines are checked one by one first, so a malformed
line is an error naming the file and line number rather than a pyarrow traceback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ANSWER = "answer"  # the metadata field of the reference answer (the math environment's)
SAVED_DATASET, SAVED_DATASET_DICT = "state.json", "dataset_dict.json"  # what datasets' save_to_disk writes

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


@dataclass(kw_only=True)
class PromptExample:
    """One prompt: the rendered text, its token ids and the row's other fields."""

    prompt: str
    prompt_token_ids: list[int]
    metadata: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)  # the prompt as chat messages (`chat_messages`)


def _check_jsonl(path: Path, prompt_key: str) -> int:
    """Validate every line of a JSONL file (or every element of a .json file holding one JSON array);
    returns the number of records."""
    if _holds_json_array(path):
        try:
            records = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{exc.lineno}: malformed JSON ({exc.msg} at column {exc.colno})") from None
        for number, record in enumerate(records, start=1):
            _check_record(record, prompt_key, f"{path}: record {number}")
        return len(records)
    count = 0
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(_malformed_line(path, lineno, exc)) from None
            _check_record(record, prompt_key, f"{path}:{lineno}")
            count += 1
    return count


def _malformed_line(path: Path, lineno: int, exc: json.JSONDecodeError) -> str:
    """Why line `lineno` does not parse; a file that is one valid JSON object spread over lines (`json.dump(obj,
    indent=2)`, e.g. {"data": [...]}) is named as such: "line 1: malformed JSON" would send its author looking for a
    syntax error that is not there."""
    try:
        whole = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return f"{path}:{lineno}: malformed JSON ({exc.msg} at column {exc.colno})"
    keys = f" with keys {sorted(whole)[:10]}" if isinstance(whole, dict) else ""
    return (f"{path} is one JSON {type(whole).__name__}{keys}, not a record per line (JSONL) nor a JSON array of "
            "records; write the records themselves, one JSON object per line or as one array [{...}, ...]")


def _holds_json_array(path: Path) -> bool:
    """A .json file whose content is one JSON array of records (what `json.dump(list)` writes), not JSONL."""
    if path.suffix != ".json":
        return False
    with path.open(encoding="utf-8") as f:
        head = f.read(4096).lstrip()
    return head.startswith("[")


def _check_record(record: Any, prompt_key: str, where: str) -> None:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object per record, got {type(record).__name__}")
    if prompt_key not in record:
        raise ValueError(f"{where}: no {prompt_key!r} field (found {sorted(record)}); {_prompt_key_hint(record)}")
    problem = prompt_problem(record[prompt_key])
    if problem:
        raise ValueError(f"{where}: field {prompt_key!r} {problem}")


PROMPT_FIELD_NAMES = ("question", "problem", "query", "instruction", "input", "messages", "text")


def _prompt_key_hint(record: Mapping[str, Any]) -> str:
    """How to name the prompt's field: prompt_key (the trainer's env.prompt_key), with a likely candidate."""
    likely = [k for k in PROMPT_FIELD_NAMES if k in record] + [k for k, v in record.items() if isinstance(v, str)]
    example = f", e.g. env.prompt_key={likely[0]}" if likely else ""
    return f"set prompt_key (the trainer's env.prompt_key) to the field that holds the prompt{example}"


def prompt_problem(prompt: Any) -> str | None:
    """Why `prompt` is neither a string nor a list of chat messages {"role", "content"}; None if it is one."""
    if isinstance(prompt, str):
        return None
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return None
    return (f"is {type(prompt).__name__} {str(prompt)[:60]!r}; a prompt is a string or a non-empty list of chat "
            'messages {"role": ..., "content": ...}')


def prompt_file_problem(path: str | Path) -> str | None:
    """Why `path` is not a prompt dataset this module reads (missing, another kind of directory); None if it is a
    file, or a `datasets` Dataset saved with `save_to_disk`."""
    path = Path(path)
    if path.is_dir():
        if (path / SAVED_DATASET).is_file():
            return None
        if (path / SAVED_DATASET_DICT).is_file():  # save_to_disk of a DatasetDict: one subdirectory per split
            splits = json.loads((path / SAVED_DATASET_DICT).read_text()).get("splits", [])
            return (f"prompt dataset {path} is a saved DatasetDict; point at one of its splits: "
                    f"{', '.join(str(path / split) for split in splits)}")
        return (f"prompt dataset {path} is a directory; expected a local .jsonl or .parquet file or a directory that "
                "datasets' save_to_disk wrote (write a datasets.Dataset with .to_json(path) or .to_parquet(path))")
    if not path.is_file():
        return f"prompt dataset {path} does not exist (expected a local .jsonl or .parquet file)"
    if path.suffix not in (*JSONL_SUFFIXES, ".parquet"):
        return (f"prompt dataset {path}: unsupported suffix {path.suffix!r}; use .jsonl, .json or .parquet (e.g. "
                "datasets.Dataset.from_csv(path).to_json('prompts.jsonl'))")
    return None


def _read_rows(path: Path, prompt_key: str) -> Any:
    import datasets

    problem = prompt_file_problem(path)
    if problem:
        raise ValueError(problem)
    if path.is_dir():  # a saved Dataset (prompt_file_problem refused every other directory)
        if not json.loads((path / SAVED_DATASET).read_text()).get("_data_files"):  # datasets fails on it unnamed
            raise ValueError(f"prompt dataset {path} holds no records")
        rows = datasets.load_from_disk(str(path), keep_in_memory=True)
    elif path.suffix in JSONL_SUFFIXES:
        if _check_jsonl(path, prompt_key) == 0:
            raise ValueError(f"prompt dataset {path} holds no records")
        return datasets.Dataset.from_json(str(path), keep_in_memory=True)
    else:  # .parquet, the one other suffix prompt_file_problem accepts
        import pyarrow.parquet as pq

        if pq.ParquetFile(path).metadata.num_rows == 0:  # datasets fails on it with no reason given
            raise ValueError(f"prompt dataset {path} holds no records")
        rows = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    if prompt_key not in rows.column_names:
        raise ValueError(f"{path}: no {prompt_key!r} column (found {rows.column_names}); "
                         f"{_prompt_key_hint(dict.fromkeys(rows.column_names, ''))}")
    return rows


def render_prompt(prompt: str | list[Mapping[str, str]], tokenizer: Any, *, apply_chat_template: bool,
                  system_prompt: str | None = None) -> str:
    """The prompt text the model sees: plain, or through the tokenizer's chat template."""
    problem = prompt_problem(prompt)
    if problem:
        raise ValueError(f"the prompt {problem}")
    if not apply_chat_template:
        if not isinstance(prompt, str):
            raise ValueError("a prompt given as chat messages needs a chat template: set env.use_chat_template=true")
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(f"apply_chat_template=True but tokenizer {type(tokenizer).__name__} has no chat_template")
    return tokenizer.apply_chat_template(chat_messages(prompt, system_prompt), tokenize=False,
                                         add_generation_prompt=True)


def chat_messages(prompt: str | list[Mapping[str, str]], system_prompt: str | None = None) -> list[dict[str, str]]:
    """The prompt as chat messages: a string is the user's turn; the system prompt goes first unless one is there."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt is not None and messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def build_examples(records: Iterable[Mapping[str, Any]], tokenizer: Any, *, prompt_key: str = "prompt",
                   apply_chat_template: bool = False, system_prompt: str | None = None,
                   answer_key: str = ANSWER) -> list[PromptExample]:
    """Records {prompt_key: ..., other: ...} -> PromptExamples (used for files and the toy generators); the
    metadata's "answer" is the record's `answer_key` field (a dotted path into nested fields)."""
    examples = []
    for number, record in enumerate(records, start=1):
        try:
            text = render_prompt(record[prompt_key], tokenizer, apply_chat_template=apply_chat_template,
                                 system_prompt=system_prompt)
        except ValueError as exc:
            raise ValueError(f"record {number}, field {prompt_key!r}: {exc}") from None
        # A chat template writes its own special tokens; a plain prompt gets the tokenizer's (e.g. BOS).
        if apply_chat_template:
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = tokenizer.encode(text, add_special_tokens=True)
            if tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
                ids = [tokenizer.bos_token_id] + ids
        metadata = {k: v for k, v in record.items() if k != prompt_key}
        if isinstance(record.get("metadata"), Mapping):  # toy generators nest their fields
            metadata = {**metadata.pop("metadata"), **metadata}
        if answer_key != ANSWER:
            metadata[ANSWER] = _field(record, answer_key, f"record {number}")
        examples.append(PromptExample(prompt=text, prompt_token_ids=list(ids), metadata=metadata,
                                      messages=chat_messages(record[prompt_key], system_prompt)))
    return examples


def _field(record: Mapping[str, Any], dotted: str, where: str) -> Any:
    """`record["a"]["b"]` for `dotted` "a.b"; a missing part is an error naming what is there."""
    value: Any = record
    for depth, part in enumerate(dotted.split(".")):
        if not isinstance(value, Mapping) or part not in value:
            found = sorted(value) if isinstance(value, Mapping) else type(value).__name__
            at = ".".join(dotted.split(".")[:depth]) or "the record"
            raise ValueError(f"{where}: no field {dotted!r} (answer_key): {at} holds {found}")
        value = value[part]
    return value


def load_prompt_dataset(path: str | Path, tokenizer: Any, *, prompt_key: str = "prompt",
                        apply_chat_template: bool = False, system_prompt: str | None = None,
                        answer_key: str = ANSWER, limit: int | None = None) -> list[PromptExample]:
    """Prompts of a local .jsonl / .parquet file, rendered and tokenized."""
    path = Path(path)
    rows = _read_rows(path, prompt_key)
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    try:
        examples = build_examples(rows, tokenizer, prompt_key=prompt_key, apply_chat_template=apply_chat_template,
                                  system_prompt=system_prompt, answer_key=answer_key)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    logger.info("loaded %d prompts from %s", len(examples), path)
    return examples
