"""The YAML that config files and command-line overrides are read with: one rule for both.

Owns the loader (a SafeLoader with its own implicit resolvers), the one-line form of YAML errors, and the
schema-directed reading of yes/no/on/off. Does not own the config schema (grpo_app.config) nor the type checks
(rl_core.config.parse_config).

PyYAML implements YAML 1.1, where an unquoted value can silently mean something else than it reads: `010` is 8
(octal), `1:30` is 90 (base 60), `2024-01-01` a date, `3e-4` a string while `3.0e-4` is a number, and
yes/no/on/off are booleans. Here an unquoted scalar is read as in YAML 1.2's core schema, as Hydra's override
grammar reads it, and as Python reads a literal:
- null: `null`, `Null`, `NULL`, `~` or nothing; booleans: `true` / `false` (also capitalised or in capitals);
- an integer: decimal without a leading zero, `1_000`, `0x1f`, `0o17`, `0b101`;
- a float: a dot or an exponent or both (`0.5`, `.5`, `1.`, `1e-5`, `3.0E+4`), `.inf`, `-.inf`, `.nan`;
- anything else is a string: `010` and `0123` keep their digits (a typed int or float key refuses them, naming
  both readings: rl_core.config), `1:30` and `2024-01-01` their text.
yes/no/on/off (and Yes, YES, ...) are read by what the key takes: the text for a string key (`env.system_prompt=yes`
is 'yes'), a boolean anywhere else, as YAML 1.1 and OmegaConf read them (`checkpointing.enabled=off`; and in the
free-form mappings, env.kwargs or an engine's section, where the string 'off' would be true in an `if`).
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal

import yaml

from rl_core.config import ConfigError

_BOOL_WORD_TAG = "tag:grpo-app,2026:bool-word"  # internal: resolved by `resolve_bool_words`, never saved
_BOOL_WORDS = {w: value for value, words in ((True, ("yes", "on")), (False, ("no", "off")))
               for word in words for w in (word, word.capitalize(), word.upper())}


@dataclasses.dataclass(frozen=True)
class BoolWord:
    """An unquoted yes/no/on/off, until the schema says whether its key takes the text or a boolean."""

    text: str
    value: bool


class ConfigLoader(yaml.SafeLoader):
    """SafeLoader with the resolvers above, that rejects a key given twice in one mapping (PyYAML keeps the last one
    silently) and reads every mapping key as its text (`{on: 1}` is {'on': 1}, not {True: 1})."""

    yaml_implicit_resolvers: dict = {}  # none of SafeLoader's YAML 1.1 resolvers: the ones below only

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: merged (and overridden) by flatten_mapping
                continue
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            key = key.text if isinstance(key, BoolWord) else key
            if key in seen:
                raise ConfigError(f"{key_node.start_mark.name}:{line}: duplicate key {key!r} (first given on line "
                                  f"{seen[key]}); keep one of them")
            seen[key] = line
        mapping = super().construct_mapping(node, deep=deep)
        return {k.text if isinstance(k, BoolWord) else k: v for k, v in mapping.items()}

    def construct_config_int(self, node: yaml.ScalarNode) -> int:
        text = self.construct_scalar(node)
        try:
            return int(text, 0)  # Python's literal rules: no leading zero, 0x / 0o / 0b, underscores
        except ValueError:  # only an explicit `!!int 010` gets here; the resolver below reads 010 as a string
            raise yaml.constructor.ConstructorError(None, None, f"{text!r} is not an integer (write it without a "
                                                    "leading zero; 0o10 is octal)", node.start_mark) from None

    def construct_bool_word(self, node: yaml.ScalarNode) -> BoolWord:
        text = self.construct_scalar(node)
        return BoolWord(text, _BOOL_WORDS[text])


_DIGITS = r"[0-9](?:_?[0-9])*"
_RESOLVERS = [  # (tag, pattern, first characters)
    ("tag:yaml.org,2002:null", r"~|null|Null|NULL|", ["~", "n", "N", ""]),
    ("tag:yaml.org,2002:bool", r"true|True|TRUE|false|False|FALSE", list("tTfF")),
    (_BOOL_WORD_TAG, "|".join(_BOOL_WORDS), list("yYnNoO")),
    ("tag:yaml.org,2002:int",
     r"[-+]?(?:0|[1-9](?:_?[0-9])*|0[xX](?:_?[0-9a-fA-F])+|0[oO](?:_?[0-7])+|0[bB](?:_?[01])+)", list("-+0123456789")),
    ("tag:yaml.org,2002:float",
     rf"[-+]?(?:(?:{_DIGITS})?\.{_DIGITS}(?:[eE][-+]?[0-9]+)?|{_DIGITS}\.?(?:[eE][-+]?[0-9]+)|{_DIGITS}\.)"
     r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN)", list("-+0123456789.")),
    ("tag:yaml.org,2002:merge", r"<<", ["<"]),  # `<<: *anchor` in a file
]
for _tag, _pattern, _first in _RESOLVERS:
    ConfigLoader.add_implicit_resolver(_tag, re.compile(rf"^(?:{_pattern})$"), _first)
ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_config_int)
ConfigLoader.add_constructor(_BOOL_WORD_TAG, ConfigLoader.construct_bool_word)


def resolve_bool_words(value: Any, annotation: Any) -> Any:
    """`value` (loaded by ConfigLoader) with each BoolWord made the text where `annotation`, the schema of its key,
    takes a string (str, a Literal of strings, a list of them), else its boolean; `annotation` is walked down
    through dataclasses, dicts and lists (Any below an unknown key: a boolean)."""
    if isinstance(value, BoolWord):
        return value.text if _takes_text(annotation) else value.value
    if isinstance(value, dict):
        hints = _field_hints(annotation)
        if hints is None:
            args = typing.get_args(annotation) if typing.get_origin(annotation) in (dict, typing.Mapping) else ()
            return {k: resolve_bool_words(v, args[1] if len(args) == 2 else Any) for k, v in value.items()}
        return {k: resolve_bool_words(v, hints.get(k, Any)) for k, v in value.items()}
    if isinstance(value, list):
        args = typing.get_args(annotation) if typing.get_origin(annotation) in (list, tuple) else ()
        return [resolve_bool_words(v, args[0] if args else Any) for v in value]
    return value


def _takes_text(annotation: Any) -> bool:
    if annotation is str:
        return True
    if typing.get_origin(annotation) is Literal:
        return any(isinstance(arg, str) for arg in typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        return bool not in args and any(_takes_text(arg) for arg in args)
    return False


def _field_hints(annotation: Any) -> dict[str, Any] | None:
    """The field types of the dataclass `annotation` stands for (itself, or the one in an Optional), or None."""
    candidates = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    for candidate in candidates:
        if dataclasses.is_dataclass(candidate):
            return typing.get_type_hints(candidate)
    return None


def yaml_error(exc: yaml.YAMLError, source: str | None) -> str:
    """A YAML syntax error in one line: `file:line:column: not valid YAML: what` (a command-line value, `source`
    None: `not valid YAML at column N: what`), and the usual fix where there is one."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
    if context and context_mark is not None and context_mark is not mark:
        problem += f" ({context}" + (f" on line {context_mark.line + 1})" if source else ")")
    if "'\\t'" in problem:
        problem += "; indent with spaces, not tabs"
    if source is None:
        return f"not valid YAML{f' at column {mark.column + 1}' if mark else ''}: {problem}"
    return f"{source}{f':{mark.line + 1}:{mark.column + 1}' if mark else ''}: not valid YAML: {problem}"
