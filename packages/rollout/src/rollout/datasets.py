"""Prompt datasets: local JSONL (or a .json array) / Parquet files, a directory `datasets`' save_to_disk wrote, or a
Hugging Face Hub dataset (a directory in the Hub's repository layout, as `hf download --repo-type dataset` writes
it, or a name `owner/name` that is no local path), read through Hugging Face `datasets`. A Hub dataset goes
through `datasets.load_dataset(source, subset, split=...)`, so a name is read by the same code as a downloaded
directory; `datasets`' Arrow files go to a scratch directory, dropped once the rows are in memory.

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
import re
import tempfile
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ANSWER = "answer"  # the metadata field of the reference answer (the math environment's)
SAVED_DATASET, SAVED_DATASET_DICT = "state.json", "dataset_dict.json"  # what datasets' save_to_disk writes

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
# a Hub dataset id, `owner/name`; a path such as ./data/x or runs/p.jsonl is never taken for one
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


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
        kinds = _FieldKinds(path, "record")
        for number, record in enumerate(records, start=1):
            _check_record(record, prompt_key, f"{path}: record {number}")
            kinds.add(record, number)
        return len(records)
    count, kinds = 0, _FieldKinds(path)
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:  # named by line, and with the fix (it was the codec's bare message)
                raise ValueError(f"{path}:{lineno}: not UTF-8 text (byte {raw[exc.start:exc.start + 1]!r} at column "
                                 f"{exc.start + 1}); save the file as UTF-8") from None
            if lineno == 1 and line.startswith("\ufeff"):
                raise ValueError(f"{path} starts with a UTF-8 byte order mark (BOM); save it as UTF-8 without BOM")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(_malformed_line(path, lineno, exc)) from None
            _check_record(record, prompt_key, f"{path}:{lineno}")
            kinds.add(record, lineno)
            count += 1
    return count


class _FieldKinds:
    """A field that holds text on one line and a number on another: datasets reads a JSONL column as one arrow type
    and converts the others without a word (the answer "007" reached the reward as 7), so it is an error naming both
    lines (records whose types agree are read as they are)."""

    def __init__(self, path: Path, unit: str = "line") -> None:
        self.path, self.unit, self.first = path, unit, {}

    def add(self, record: Mapping[str, Any], lineno: int) -> None:
        for key, value in record.items():
            kind = "text" if isinstance(value, str) else "a number" if isinstance(value, int | float) and not \
                isinstance(value, bool) else None
            if kind is None:
                continue
            seen = self.first.setdefault(key, (kind, lineno))
            if seen[0] != kind:
                raise ValueError(f"{self.path}: {self.unit} {lineno}: field {key!r} is {kind} ({value!r}), but "
                                 f"{seen[0]} in {self.unit} {seen[1]}: a column is read as one type, and the other lines would be converted "
                                 f"(\"007\" to 7); write every {key!r} the same way (e.g. all as strings)")


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
    if isinstance(prompt, str):  # empty, the model would be sampled from BOS alone: a data bug
        return None if prompt.strip() else f"is an empty string {prompt!r}; every prompt needs text"
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return None
    return (f"is {type(prompt).__name__} {str(prompt)[:60]!r}; a prompt is a string or a non-empty list of chat "
            'messages {"role": ..., "content": ...}')


def is_hub_dataset(path: str | Path) -> bool:
    """`path` is read by `datasets.load_dataset`: a directory save_to_disk did not write (the Hub's repository
    layout: train.jsonl, data/train-00000-of-00001.parquet, main/test-*.parquet under a README declaring `configs:`),
    or a Hub name `owner/name` that is no local path. The string as given: Path("./a/b") would read "a/b"."""
    local = Path(path)
    if local.is_dir():
        return not ((local / SAVED_DATASET).is_file() or (local / SAVED_DATASET_DICT).is_file())
    return (not local.exists() and HUB_NAME.fullmatch(str(path)) is not None
            and local.suffix not in (*JSONL_SUFFIXES, ".parquet"))


def prompt_data_problem(path: str | Path, *, split: str = "train", subset: str | None = None) -> str | None:
    """Why `path` is not a prompt dataset this module reads (missing, another kind of directory, a Hub dataset
    without that split or subset); None if it is one. `split` and `subset` apply to Hub datasets only: a file or a
    save_to_disk directory is one split."""
    if is_hub_dataset(path):
        return _hub_problem(str(path), split, subset)
    path = Path(path)
    if path.is_dir():
        if (path / SAVED_DATASET).is_file():
            return None
        # save_to_disk of a DatasetDict: one subdirectory per split (is_hub_dataset took every other directory)
        splits = json.loads((path / SAVED_DATASET_DICT).read_text()).get("splits", [])
        return (f"prompt dataset {path} is a saved DatasetDict; point at one of its splits: "
                f"{', '.join(str(path / split) for split in splits)}")
    if not path.is_file():
        return (f"prompt dataset {path} does not exist (expected a local .jsonl, .json or .parquet file, a directory "
                "written by datasets' save_to_disk, or a Hugging Face Hub dataset name)")
    if path.suffix not in (*JSONL_SUFFIXES, ".parquet"):
        return (f"prompt dataset {path}: unsupported suffix {path.suffix!r}; use .jsonl, .json or .parquet (e.g. "
                "datasets.Dataset.from_csv(path).to_json('prompts.jsonl'))")
    return None


def _scratch_cache() -> AbstractContextManager[str]:
    """Where `datasets` writes its Arrow files and locks while it reads (else ~/.cache/huggingface/datasets);
    removed on exit, after the rows were read into memory (keep_in_memory=True)."""
    return tempfile.TemporaryDirectory(prefix="prompt-dataset-")


def _hub_problem(source: str, split: str, subset: str | None) -> str | None:
    """Why `datasets.load_dataset(source, subset, split=split)` would fail, found from the dataset's file listing
    (`load_dataset_builder`, which reads no data): no data files, no such dataset or no Hub to ask, a subset to
    choose, no such split."""
    import datasets

    try:
        with _scratch_cache() as cache:
            builder = datasets.load_dataset_builder(source, subset, cache_dir=cache)
    except (ConnectionError, FileNotFoundError) as exc:  # DatasetNotFoundError, EmptyDatasetError among them
        return _not_found(source, exc)
    except ValueError as exc:  # "Config name is missing", "BuilderConfig 'x' not found"
        return _subset_problem(source, subset) or f"prompt dataset {source}: {exc}"
    splits = [str(name) for name in builder.config.data_files or ()]
    if split not in splits:
        of = f", subset {builder.config.name!r}," if subset else ""
        return f"prompt dataset {source}{of} has no split {split!r}; choose the split among {splits}"
    return None


def _subset_problem(source: str, subset: str | None) -> str | None:
    """The subsets (the Hub's configs, e.g. GSM8K's 'main' and 'socratic') to choose from, when `subset` is none
    of them or is unset and there are several."""
    import datasets

    subsets = datasets.get_dataset_config_names(source)
    if subset is None and len(subsets) > 1:
        return f"prompt dataset {source} has several subsets, {subsets}, and none is chosen; choose the subset"
    if subset is not None and subset not in subsets:
        return f"prompt dataset {source} has no subset {subset!r}; choose the subset among {subsets}"
    return None


def _not_found(source: str, exc: Exception) -> str:
    """A Hub-layout directory without data files, or a name neither local nor found on the Hub: how to get it."""
    if Path(source).is_dir():
        return (f"prompt dataset {source} is a directory; expected a local .jsonl or .parquet file or a directory that "
                "datasets' save_to_disk wrote, or one in the Hugging Face Hub's layout (train.jsonl, "
                "data/train-00000-of-00001.parquet, ...), and it holds no data files (write a datasets.Dataset with "
                ".to_json(path) or .to_parquet(path))")
    reason = "could not be reached" if isinstance(exc, ConnectionError) else f"has no dataset {source!r}"
    local = source.split("/")[-1]
    return (f"prompt dataset {source!r} is not a local file or directory, and the Hugging Face Hub {reason} ({exc}); "
            f"download it where the Hub is reachable, `hf download --repo-type dataset {source} --local-dir {local}` "
            f"(huggingface-cli download before huggingface_hub 1.0), and point at that directory: {local}")


def _read_rows(path: str | Path, prompt_key: str, split: str, subset: str | None) -> Any:
    problem = prompt_data_problem(path, split=split, subset=subset)
    if problem:
        raise ValueError(problem)
    with _scratch_cache() as cache:
        rows = _load_rows(path, prompt_key, split, subset, cache)
    if prompt_key not in rows.column_names:
        raise ValueError(f"{path}: no {prompt_key!r} column (found {rows.column_names}); "
                         f"{_prompt_key_hint(dict.fromkeys(rows.column_names, ''))}")
    return rows


def _load_rows(path: str | Path, prompt_key: str, split: str, subset: str | None, cache: str) -> Any:
    """The rows of a source prompt_data_problem accepted, read into memory (`cache`: datasets' scratch files)."""
    import datasets

    if is_hub_dataset(path):  # the one call for a name and a downloaded directory alike
        return datasets.load_dataset(str(path), subset, split=split, cache_dir=cache, keep_in_memory=True)
    path = Path(path)
    if path.is_dir():  # a saved Dataset (prompt_data_problem refused a saved DatasetDict)
        if not json.loads((path / SAVED_DATASET).read_text()).get("_data_files"):  # datasets fails on it unnamed
            raise ValueError(f"prompt dataset {path} holds no records")
        return datasets.load_from_disk(str(path), keep_in_memory=True)
    if path.suffix in JSONL_SUFFIXES:
        if _check_jsonl(path, prompt_key) == 0:
            raise ValueError(f"prompt dataset {path} holds no records")
        return datasets.Dataset.from_json(str(path), cache_dir=cache, keep_in_memory=True)
    import pyarrow.parquet as pq  # .parquet, the one other suffix prompt_data_problem accepts

    try:
        rows = pq.ParquetFile(path).metadata.num_rows
    except Exception as exc:  # pyarrow's message names no file ("Parquet magic bytes not found in footer")
        raise ValueError(f"{path} is not a readable Parquet file ({type(exc).__name__}: {exc})") from None
    if rows == 0:  # datasets fails on it with no reason given
        raise ValueError(f"prompt dataset {path} holds no records")
    return datasets.Dataset.from_parquet(str(path), cache_dir=cache, keep_in_memory=True)


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
    messages = chat_messages(prompt, system_prompt)
    if messages[-1].get("role") == "assistant":  # SFT data: the answer would be in the prompt the model continues
        raise ValueError("the last message is the assistant's (an answer, as in SFT data): a GRPO prompt ends with "
                         "the turn the model answers; drop the trailing assistant message (keep the answer in a field "
                         "the reward reads, e.g. 'answer')")
    from jinja2 import TemplateError

    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except TemplateError as exc:  # the model's template refused these messages (e.g. no system role)
        raise ValueError(f"the tokenizer's chat template (policy.model_name's tokenizer_config.json or "
                         f"chat_template.jinja) failed on these messages: {type(exc).__name__}: {exc}") from None


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
    records = list(records)
    texts = []
    for number, record in enumerate(records, start=1):
        try:
            texts.append(render_prompt(record[prompt_key], tokenizer, apply_chat_template=apply_chat_template,
                                       system_prompt=system_prompt))
        except ValueError as exc:
            raise ValueError(f"record {number}, field {prompt_key!r}: {exc}") from None
    # All prompts in one call each: a fast tokenizer encodes a list in parallel (in Rust). One call per prompt took
    # twice as long here (10,000 toy prompts, 2 cores: 1.42 s -> 0.72 s; with the chat template 1.68 s -> 0.95 s).
    plain = _encode(tokenizer, texts, add_special_tokens=False)
    lossy = [(number, text, back) for number, (text, back)  # as the model sees it
             in enumerate(zip(texts, tokenizer.batch_decode(plain, clean_up_tokenization_spaces=False)), start=1)
             if back != text]
    # A chat template writes its own special tokens; a plain prompt gets the tokenizer's (e.g. BOS).
    token_ids = plain if apply_chat_template else _encode(tokenizer, texts, add_special_tokens=True)
    examples, own_system = [], 0
    for number, (record, text, ids) in enumerate(zip(records, texts, token_ids), start=1):
        if not apply_chat_template and tokenizer.bos_token_id is not None and (not ids or ids[0] != tokenizer.bos_token_id):
            ids = [tokenizer.bos_token_id] + ids
        metadata = {k: v for k, v in record.items() if k != prompt_key}
        if isinstance(record.get("metadata"), Mapping):  # toy generators nest their fields
            metadata = {**metadata.pop("metadata"), **metadata}
        if answer_key != ANSWER:
            metadata[ANSWER] = _field(record, answer_key, f"record {number}")
        examples.append(PromptExample(prompt=text, prompt_token_ids=list(ids), metadata=metadata,
                                      messages=chat_messages(record[prompt_key], system_prompt)))
        own_system += isinstance(record[prompt_key], list) and record[prompt_key][0].get("role") == "system"
    if system_prompt is not None and own_system:  # chat_messages keeps theirs
        logger.warning("%d of %d prompts start with a system message of their own, which stays: the system prompt "
                       "(the trainer's env.system_prompt) applies to the others only", own_system, len(examples))
    if lossy:  # silent otherwise: the tokenizer drops or replaces what it cannot encode
        number, text, back = lossy[0]
        logger.warning("%d of %d prompts lose characters in the tokenizer (record %d: %r reads back as %r): the model "
                       "sees them without; use a model whose tokenizer covers the text (policy.model_name)",
                       len(lossy), len(examples), number, text[:80], back[:80])
    return examples


def _encode(tokenizer: Any, texts: list[str], *, add_special_tokens: bool) -> list[list[int]]:
    return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"] if texts else []


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


def load_prompt_dataset(path: str | Path, tokenizer: Any, *, split: str = "train", subset: str | None = None,
                        prompt_key: str = "prompt", apply_chat_template: bool = False,
                        system_prompt: str | None = None, answer_key: str = ANSWER,
                        limit: int | None = None) -> list[PromptExample]:
    """Prompts of a local .jsonl / .parquet file, a save_to_disk directory or `split` (of `subset`) of a Hub
    dataset, rendered and tokenized."""
    rows = _read_rows(path, prompt_key, split, subset)
    if limit is not None:
        rows = rows.select(range(min(limit, len(rows))))
    try:
        examples = build_examples(rows, tokenizer, prompt_key=prompt_key, apply_chat_template=apply_chat_template,
                                  system_prompt=system_prompt, answer_key=answer_key)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    logger.info("loaded %d prompts from %s", len(examples), path)
    return examples
