"""Typed configs: plain `kw_only` dataclasses, validated from nested mappings (YAML) before any work.

Owns the validator every package uses (`parse_config`), the shared `policy.*` schema that both
engines read and the `loss.*` schema (rl_core.losses computes the loss). Imports no torch: a trainer reads and
checks a config before its heavy imports. Engine-specific sections (`policy.engine_cfg` for any engine chosen by `policy.engine`;
`policy.dtensor_cfg`, `policy.megatron_cfg` for the built-in two) stay raw mappings here and are
validated by the engine package that owns them (its `validate_config`), so rl-core imports no engine.

Errors name the dotted key, the value received, what was expected and, for unknown keys, the closest
valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

T = TypeVar("T")
logger = logging.getLogger(__name__)

# policy.logprob_chunk_tokens: 1536 tokens x 151936 (Qwen2.5's vocabulary) x 4 bytes = 0.87 GiB per float32
# intermediate of the log-softmax (rl_core.logprobs)
DEFAULT_LOGPROB_CHUNK_TOKENS = 1536


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """A config warning once per process: a config rebuilt with dataclasses.replace (the trainer resolves the
    model path that way) runs its checks again."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning("%s", message)


class ConfigError(ValueError):
    """A config value or key is invalid; the message names the key and the fix."""


def closest_key(key: str, candidates: list[str]) -> str | None:
    """The candidate closest to `key`, ignoring case (`Adamw` -> `AdamW`), or None."""
    by_lower = {c.lower(): c for c in candidates}
    match = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.5)
    return by_lower[match[0]] if match else None


class UnknownKeyError(ConfigError):
    """A config key the schema does not have: `dotted` is the key as written, `near` the suggested keys (default:
    the closest of its level, if any), `others` the other keys of its level the schema does not have either (named
    too: a config with three of them was three runs), `elsewhere` those of other sections, described
    (`describe_unknown_keys`)."""

    def __init__(self, path: str, key: str, candidates: list[str], near: list[str] | None = None,
                 others: list[str] = (), elsewhere: list[str] = ()) -> None:
        close = closest_key(key, candidates)
        self.path, self.key, self.candidates, self.others = path, key, candidates, list(others)
        self.elsewhere = list(elsewhere)
        self.dotted = _join(path, key)
        self.near = near or ([_join(path, close)] if close else [])
        hint = f"; did you mean {' or '.join(repr(n) for n in self.near)}?" if self.near else "."
        also = f" Also unknown here: {describe_unknown_keys(path, self.others, candidates)}." if self.others else ""
        other_sections = f". Unknown in other sections too: {', '.join(self.elsewhere)}" if self.elsewhere else ""
        super().__init__(f"unknown config key '{self.dotted}'{hint}{also} Valid keys here: {sorted(candidates)}"
                         f"{other_sections}")


def describe_unknown_keys(path: str, keys: list[str], candidates: list[str]) -> str:
    """`keys` of section `path`, quoted and dotted, each with the closest of `candidates` where one is near."""
    def described(key: str) -> str:
        near = closest_key(key, candidates)
        return f"'{_join(path, key)}'" + (f" (did you mean '{_join(path, near)}'?)" if near else "")

    return ", ".join(described(key) for key in keys)


def check_known_keys(path: str, keys: Iterable[str], candidates: list[str]) -> None:
    """Raise UnknownKeyError for the first of `keys` (of section `path`) not in `candidates`, naming the others."""
    unknown = [key for key in keys if key not in candidates]
    if unknown:
        raise UnknownKeyError(path, unknown[0], candidates, others=unknown[1:])


def check_schema_keys(cls: type, data: Mapping[str, Any]) -> None:
    """Raise UnknownKeyError for the first unknown key of `data` (in the order `parse_config` finds them), naming
    every other one of the whole tree, and before any value is read: a caller that resolves values first (probing
    the hardware) reports a typo at once."""
    sections = [(path, unknown, names) for path, _, unknown, names in _unknown_by_section(cls, data, "")]
    if sections:
        (path, unknown, candidates), rest = sections[0], sections[1:]
        raise UnknownKeyError(path, unknown[0], candidates, others=unknown[1:],
                              elsewhere=[describe_unknown_keys(*section) for section in rest])


def schema_keys(cls: type, path: str = "") -> list[str]:
    """Every dotted key of dataclass schema `cls`: its fields, those of nested dataclasses, and the keys of a
    mapping field's default (`policy.optimizer.kwargs.lr`)."""
    keys = []
    for f in dataclasses.fields(cls):
        dotted = _join(path, f.name)
        keys.append(dotted)
        annotation = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(annotation):
            keys += schema_keys(annotation, dotted)
        elif f.default_factory is not dataclasses.MISSING and isinstance(default := f.default_factory(), Mapping):
            keys += [_join(dotted, k) for k in default]
    return keys


def unknown_keys(cls: type, data: Mapping[str, Any], path: str = "") -> list[str]:
    """Every key of `data` that dataclass schema `cls` lacks, dotted, in the order `parse_config` finds them (it
    stops at the first): a section's own, then those of its subsections. An unknown section is listed by its
    innermost keys; a mapping field (`policy.engine_cfg`) takes any key."""
    return [dotted for section_path, section, unknown, _ in _unknown_by_section(cls, data, path) for key in unknown
            for dotted in _innermost_keys(section[key], _join(section_path, key))]


def _unknown_by_section(cls: type, data: Mapping[str, Any],
                        path: str) -> list[tuple[str, Mapping[str, Any], list[str], list[str]]]:
    """(path, section, its keys schema `cls` lacks, its valid keys) for each section of `data` with unknown keys."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [key for key in data if key not in names]
    found = [(path, data, unknown, names)] if unknown else []
    for key, value in data.items():
        if key in names and isinstance(value, Mapping) and (section := _dataclass_in(hints[key])):
            found += _unknown_by_section(section, value, _join(path, key))
    return found


def _innermost_keys(value: Any, dotted: str) -> list[str]:
    if not isinstance(value, Mapping) or not value:
        return [dotted]
    return [k for key, item in value.items() for k in _innermost_keys(item, _join(dotted, key))]


def _dataclass_in(annotation: Any) -> type | None:
    """The dataclass `annotation` is, or one of its union (`SchedulerConfig | None`), else None."""
    candidates = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else (annotation,)
    return next((c for c in candidates if dataclasses.is_dataclass(c)), None)


def with_keys_elsewhere(exc: UnknownKeyError, root: type) -> UnknownKeyError:
    """`exc`, when it has no suggestion of its level, suggesting the keys of that name elsewhere in schema `root`
    (`policy.lr` -> `policy.optimizer.kwargs.lr`; `loss.temperature` -> `policy.temperature`, ...)."""
    if exc.near:
        return exc
    same_name = [k for k in schema_keys(root) if k.rsplit(".", 1)[-1].lower() == exc.key.lower()]
    return UnknownKeyError(exc.path, exc.key, exc.candidates, near=same_name[:3], others=exc.others,
                           elsewhere=exc.elsewhere) if same_name else exc


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _convert(value: Any, annotation: Any, path: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(value, arg, path)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(f"'{path}' = {value!r} matches none of {annotation}: {'; '.join(errors)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"'{path}' = {value!r} is not allowed; choose one of {list(args)}")
        return value
    if dataclasses.is_dataclass(annotation):
        if isinstance(value, annotation):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"'{path}' must be a mapping of {annotation.__name__} keys; got {value!r}")
        return parse_config(annotation, value, path)
    if origin in (dict, Mapping) or annotation in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"'{path}' must be a mapping; got {type(value).__name__} {value!r}")
        return dict(value)
    if origin in (list, tuple) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"'{path}' must be a list; got {type(value).__name__} {value!r}")
        item = args[0] if args else Any
        converted = [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(converted) if (origin or annotation) is tuple else converted
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"'{path}' must be a number; got {type(value).__name__} {value!r}{yaml_hint(value)}")
        return float(value)
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"'{path}' must be an integer; got {type(value).__name__} {value!r}{yaml_hint(value)}")
        return value
    if annotation in (bool, str):
        if not isinstance(value, annotation):
            hint = yaml_hint(value) if annotation is str else ""
            raise ConfigError(
                f"'{path}' must be a {annotation.__name__}; got {type(value).__name__} {value!r}{hint}"
            )
        return value
    return value


def yaml_hint(value: Any) -> str:
    """The YAML reading behind a wrong type, where it is a common one."""
    if isinstance(value, Mapping | list):
        return " (YAML reads an unquoted 'a: b' as a mapping and '[a]' as a list: quote the value)"
    if not isinstance(value, str):
        return ""
    if re.search(r"\$\{[^}]*\}", value):  # NeMo-RL's and Hydra's configs interpolate with OmegaConf
        return " (${...} is an OmegaConf interpolation, which this config does not evaluate: write the value itself)"
    leading_zero = re.fullmatch(r"([-+]?)(0[0-9_]*[0-9])", value)  # the trainer's YAML keeps 010 a string
    if leading_zero:
        sign, digits = leading_zero[1].replace("+", ""), leading_zero[2].replace("_", "")
        octal_digits = set(digits) <= set("01234567") and int(digits, 8) != int(digits)
        decimal, octal = f"{sign}{int(digits)}", f"{sign}{int(digits, 8)}" if octal_digits else None
        if octal:
            return (f" (a leading zero is ambiguous: YAML 1.1 reads {value} as the octal {octal}, YAML 1.2 as "
                    f"{decimal}; write {decimal}, or {sign}{int(digits, 8):#o} for the octal {octal})")
        return f" (write {decimal}, without the leading zero)"
    if re.fullmatch(r"[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?", value):
        return f" (YAML 1.1 reads {value} as a base-60 number; write the number itself)"
    if value.lower().lstrip("+-") in ("inf", "infinity", "nan"):
        return f" (YAML writes it {value[0] if value[0] in '+-' else ''}.{value.lower().lstrip('+-')[:3]})"
    if "." not in value and "e" in value.lower():  # YAML 1.1's float needs a dot
        try:
            number = float(value)
        except ValueError:
            return ""
        return f" (YAML 1.1 reads {value} as a string; write {number:.1e})"
    return ""


def parse_config(cls: type[T], data: Mapping[str, Any] | None, path: str = "") -> T:
    """Build dataclass `cls` from a mapping, checking keys and types recursively."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    check_known_keys(path, data, names)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in data:
            kwargs[f.name] = _convert(data[f.name], hints[f.name], _join(path, f.name))
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            kind = getattr(hints[f.name], "__name__", hints[f.name])
            raise ConfigError(f"config key '{_join(path, f.name)}' is required ({kind}); set it")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"'{path or cls.__name__}': {exc}") from exc


def to_dict(cfg: Any) -> Any:
    """A dataclass config as plain nested dicts (for saving the resolved config)."""
    return dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else cfg


# ---- the shared policy.* schema, read by every engine -------------------------------------------------


@dataclass(kw_only=True)
class OptimizerConfig:
    """Any torch.optim class by name, with its keyword arguments (`lr` required)."""

    name: str = "AdamW"
    kwargs: dict[str, Any] = field(default_factory=lambda: {"lr": 1e-6, "weight_decay": 0.01})

    def __post_init__(self) -> None:
        self.name = self.name.removeprefix("torch.optim.")  # NeMo-RL's spelling of the class
        if "lr" not in self.kwargs:
            raise ConfigError("policy.optimizer.kwargs.lr is required (the learning rate)")


@dataclass(kw_only=True)
class SchedulerConfig:
    """Linear warmup to the optimizer's lr, then constant, cosine or linear decay to min_lr_ratio * lr."""

    warmup_steps: int = 0
    decay: Literal["constant", "cosine", "linear"] = "constant"
    total_steps: int = 1000
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ConfigError(f"policy.scheduler.warmup_steps must be >= 0 and total_steps >= 1; got "
                              f"{self.warmup_steps} and {self.total_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:  # below 0 the lr turns negative: the model trains away from the reward
            raise ConfigError(f"policy.scheduler.min_lr_ratio must be in [0, 1] (a fraction of the lr); got "
                              f"{self.min_lr_ratio}")

    def lr_factor(self, step: int) -> float:
        """Multiplier of the base lr at optimizer step `step` (0-based); every engine uses this formula.

        Warmup is (step + 1) / warmup_steps, so the first step already trains; a skipped (non-finite)
        step does not advance the schedule.
        """
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps))
        shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if self.decay == "cosine" else 1.0 - progress
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * shape


@dataclass(kw_only=True)
class SequencePackingConfig:
    enabled: bool = False
    algorithm: Literal["mffd", "ffd", "bfd", "concat"] = "mffd"
    train_mb_tokens: int = 4096
    logprob_mb_tokens: int = 8192


@dataclass(kw_only=True)
class DynamicBatchingConfig:
    """Micro-batches cut by a padded-token budget instead of a fixed sequence count."""

    enabled: bool = False
    train_mb_tokens: int = 4096
    logprob_mb_tokens: int = 8192
    sequence_length_round: int = 64


def micro_batch_limits(policy: PolicyConfig, *, training: bool, seq_multiple: int) -> dict[str, Any]:
    """Keyword arguments of `seqpack.plan_dp_micro_batches` for the policy's batching mode (both engines).

    seq_multiple: the multiple the engine pads every sequence to (packing: each packed sequence; padded:
    the row width). `round_to` is what seqpack prices a sequence at, so it must be a multiple of both
    the engine's multiple and dynamic batching's `sequence_length_round`: their lcm (the max of the two
    undercounts, e.g. 64 vs TP=3, and a micro-batch would run past its token budget).
    """
    if policy.sequence_packing.enabled:
        packing = policy.sequence_packing
        return dict(max_tokens=packing.train_mb_tokens if training else packing.logprob_mb_tokens,
                    packing=True, algorithm=packing.algorithm, round_to=seq_multiple)
    if policy.dynamic_batching.enabled:
        dynamic = policy.dynamic_batching
        return dict(max_tokens=dynamic.train_mb_tokens if training else dynamic.logprob_mb_tokens,
                    round_to=math.lcm(dynamic.sequence_length_round, seq_multiple))
    return dict(max_seqs=policy.train_micro_batch_size if training else policy.logprob_batch_size,
                round_to=seq_multiple)


@dataclass(kw_only=True)
class PolicyConfig:
    """`policy.*`: the model and the training settings both engines share."""

    model_name: str
    precision: Literal["float32", "bfloat16", "float16"] = "float32"
    train_global_batch_size: int = 32
    train_micro_batch_size: int = 4
    logprob_batch_size: int = 8
    max_grad_norm: float | None = 1.0
    temperature: float = 1.0  # logits are divided by the sampling temperature before log-softmax
    # the sampler's top-k / top-p: logprobs are then of the distribution it draws from, renormalised over the
    # tokens it keeps (rl_core.logprobs); 0 / 1.0 = the full vocabulary
    top_k: int = 0
    top_p: float = 1.0
    # tokens per chunk of the fp32 log-softmax / entropy (rl_core.logprobs): bounds those intermediates to
    # logprob_chunk_tokens x vocab x 4 bytes (0.87 GiB at a 152k vocabulary by default)
    logprob_chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    sequence_packing: SequencePackingConfig = field(default_factory=SequencePackingConfig)
    dynamic_batching: DynamicBatchingConfig = field(default_factory=DynamicBatchingConfig)
    # The engine: `engine: <registered name>` (any engine, incl. third-party ones that get their section
    # as `engine_cfg`), or the seeds' spelling `megatron_cfg.enabled` / `dtensor_cfg.enabled` for the
    # built-in two. `dtensor_cfg.enabled` defaults to "not megatron", so `megatron_cfg.enabled=true` switches.
    engine: str | None = None
    engine_cfg: dict[str, Any] = field(default_factory=dict)
    dtensor_cfg: dict[str, Any] = field(default_factory=dict)
    megatron_cfg: dict[str, Any] = field(default_factory=lambda: {"enabled": False})

    def __post_init__(self) -> None:
        for key in ("train_global_batch_size", "train_micro_batch_size", "logprob_batch_size", "logprob_chunk_tokens"):
            if getattr(self, key) < 1:
                raise ConfigError(f"policy.{key} must be >= 1; got {getattr(self, key)}")
        if not self.temperature >= MIN_TEMPERATURE:
            raise ConfigError(f"policy.temperature must be >= {MIN_TEMPERATURE} (below it logits / temperature "
                              f"overflow float32); got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"policy.top_k must be >= 0 (0 = off); got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"policy.top_p must be in (0, 1] (1 = off); got {self.top_p}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError(f"policy.max_grad_norm must be > 0, or null for no clipping; got {self.max_grad_norm}")
        if self.sequence_packing.enabled and self.dynamic_batching.enabled:
            raise ConfigError("policy.sequence_packing.enabled and policy.dynamic_batching.enabled are exclusive "
                              "(packing already cuts micro-batches by a token budget): set "
                              "policy.sequence_packing.enabled=false to batch padded rows by tokens")
        for section in BUILTIN_ENGINE_SECTIONS.values():  # a string here ('maybe', 'False') would read as true
            switch = getattr(self, section).get("enabled")
            if switch is not None and not isinstance(switch, bool):
                raise ConfigError(f"'policy.{section}.enabled' must be a bool (true or false); got "
                                  f"{type(switch).__name__} {switch!r}")
        switched_on = [name for name in BUILTIN_ENGINE_SECTIONS if self._section(name).get("enabled", False)]
        if self.engine is not None:
            self._check_engine_key(switched_on)
            self._warn_unused_sections()
            return
        if switched_on == ["dtensor", "megatron"]:
            raise ConfigError(
                "Configure either Megatron (policy.megatron_cfg.enabled=true) or DTensor "
                "(policy.dtensor_cfg.enabled=true), not both."
            )
        if not switched_on and not self.dtensor_cfg.get("enabled", True):
            raise ConfigError(
                "No training engine is enabled: set policy.engine=<name>, policy.dtensor_cfg.enabled=true or "
                "policy.megatron_cfg.enabled=true."
            )
        if self.engine_cfg:
            raise ConfigError("policy.engine_cfg is the section of an engine chosen by policy.engine; set "
                              "policy.engine too, or put these keys under policy.dtensor_cfg / policy.megatron_cfg")
        self._warn_unused_sections()

    def _section(self, name: str) -> dict[str, Any]:
        return getattr(self, BUILTIN_ENGINE_SECTIONS[name])

    def _check_engine_key(self, switched_on: list[str]) -> None:
        """`policy.engine` set: no `*_cfg.enabled` switch may name another engine, one options section."""
        if not self.engine:
            raise ConfigError("policy.engine is empty; name a registered engine (e.g. 'dtensor', 'megatron')")
        for name in switched_on:
            if name != self.engine:
                raise ConfigError(f"policy.engine={self.engine!r} conflicts with policy.{name}_cfg.enabled=true; "
                                  f"remove one of the two keys")
        if self.engine in BUILTIN_ENGINE_SECTIONS and self.engine_cfg and self._own_options(self.engine):
            section = BUILTIN_ENGINE_SECTIONS[self.engine]
            raise ConfigError(f"policy.engine_cfg and policy.{section} both configure engine {self.engine!r}; "
                              "use one of the two sections")

    def _warn_unused_sections(self) -> None:
        """Options under a built-in engine's section that is not the one running do nothing (a user who sets
        `dtensor_cfg.tensor_parallel_size=2` on a Megatron run gets TP=1): say so, naming the section that counts.
        LoRA switched on there is an error: the engine that runs would train every weight, another run than the one
        asked for, with the memory of full training."""
        for name, section in BUILTIN_ENGINE_SECTIONS.items():
            unused = self._own_options(name)
            lora = unused.get("lora_cfg")
            if name != self.engine_name and isinstance(lora, dict) and lora.get("enabled"):
                raise ConfigError(f"policy.{section}.lora_cfg.enabled=true, but the {self.engine_name!r} engine runs "
                                  f"({self.engine_config_key}) and would train every weight: LoRA goes under "
                                  f"{self.engine_options_key}.lora_cfg (the same keys), or run the engine of "
                                  f"policy.{section}")
            if unused and name != self.engine_name:
                _warn_once(f"policy.{section} ({', '.join(unused)}) is unused: the {self.engine_name!r} engine runs "
                           f"({self.engine_config_key}); its options are {self.engine_options_key}")

    def _own_options(self, name: str) -> dict[str, Any]:
        return {k: v for k, v in self._section(name).items() if k != "enabled"}

    @property
    def engine_name(self) -> str:
        """The registry name of the configured engine (the one place that maps config to a name)."""
        if self.engine is not None:
            return self.engine
        return "megatron" if self.megatron_cfg.get("enabled", False) else "dtensor"

    @property
    def engine_config_key(self) -> str:
        """The config key that chose the engine, for error messages."""
        return "policy.engine" if self.engine is not None else f"policy.{self.engine_name}_cfg.enabled"

    @property
    def engine_options(self) -> dict[str, Any]:
        """The engine's own section, minus the `enabled` switch: `policy.engine_cfg`, or for the built-in
        engines their `policy.<name>_cfg` (either spelling; both set is a config error)."""
        if self.engine_name in BUILTIN_ENGINE_SECTIONS and not self.engine_cfg:
            return self._own_options(self.engine_name)
        return dict(self.engine_cfg)

    @property
    def engine_options_key(self) -> str:
        """The dotted key `engine_options` came from (error messages name what the user wrote)."""
        if self.engine_name in BUILTIN_ENGINE_SECTIONS and not self.engine_cfg:
            return f"policy.{BUILTIN_ENGINE_SECTIONS[self.engine_name]}"
        return "policy.engine_cfg"


# The smallest sampling temperature (vLLM's greedy threshold): below it logits / temperature overflow float32
# `loss.*`: the clipped policy-gradient loss's settings (rl_core.losses computes it, rl_core.kl and
# rl_core.importance its terms); here, with the other schemas, so that reading a config imports no torch
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"]
KLKind = Literal["k1", "k2", "k3"]
ISLevel = Literal["token", "sequence"]
ISMode = Literal["tis", "icepop", "seq-mask-tis"] | None


@dataclass(kw_only=True)
class ImportanceConfig:
    """`loss.importance`: correction for trainer/inference mismatch (rl_core.importance)."""

    enabled: bool = False
    level: ISLevel = "token"
    mode: ISMode = "tis"
    low: float = 0.0
    high: float = 2.0

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:  # checked even when disabled: the IS metrics use the bounds too
            raise ConfigError(f"loss.importance needs 0 <= low <= high; got low={self.low}, high={self.high}")


@dataclass(kw_only=True)
class LossConfig:
    """`loss.*`: the clipped policy-gradient loss settings."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    dual_clip: float | None = None
    agg: Aggregation = "token-mean"
    kl_coef: float = 0.0
    kl_kind: KLKind = "k3"
    kl_input_clamp: float | None = 20.0
    kl_output_clamp: float | None = 10.0
    sequence_level_ratio: bool = False
    importance: ImportanceConfig = field(default_factory=ImportanceConfig)

    def __post_init__(self) -> None:
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise ConfigError(f"loss.dual_clip must be > 1 (e.g. 3.0) or null; got {self.dual_clip}")
        if self.eps_low < 0 or self.eps_high < 0:
            raise ConfigError(f"loss.eps_low/eps_high must be >= 0; got {self.eps_low}, {self.eps_high}")
        if self.eps_low > 1:
            raise ConfigError(f"loss.eps_low={self.eps_low} puts the lower clip bound 1 - eps_low below 0, where no ratio "
                              "is: use eps_low <= 1 (1 turns the lower clip off)")
        if self.kl_coef < 0:
            raise ConfigError(f"loss.kl_coef must be >= 0 (a negative one rewards leaving the reference); "
                              f"got {self.kl_coef}")


MIN_TEMPERATURE = 1e-5

# The built-in engines' own sections (the seeds' spelling); any other engine reads `policy.engine_cfg`.
BUILTIN_ENGINE_SECTIONS = {"dtensor": "dtensor_cfg", "megatron": "megatron_cfg"}
