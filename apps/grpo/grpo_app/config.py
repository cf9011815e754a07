"""The trainer's config: one `GRPOConfig` tree, loaded from YAML with `defaults:` inheritance and
dotted command-line overrides, validated before any worker starts.

Owns: loading (`defaults:` inheritance, overrides; the YAML dialect itself is grpo_app.config_yaml) and the
trainer-level sections (grpo, generation, env, cluster, logger, checkpointing). Reuses the packages' own schemas
for `policy` (rl_core.config) and `loss` (rl_core.losses); engine-specific sections are validated by the engine's
`validate_config`, early in `grpo_app.preflight` and again when the engine is built.
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from grpo_app.config_yaml import ConfigLoader, resolve_bool_words, yaml_error
from grpo_app.devices import Hardware, detect_hardware, resolve_auto
from grpo_app.ported_configs import explain_unknown_key
from rl_core.config import (
    ConfigError,
    LossConfig,
    PolicyConfig,
    UnknownKeyError,
    check_schema_keys,
    closest_key,
    micro_batch_limits,
    parse_config,
)

logger = logging.getLogger(__name__)
CONFIG_DIR = Path(__file__).resolve().parent / "configs"  # inside the package: the wheel ships them
DEFAULT_CONFIG = CONFIG_DIR / "cpu_default.yaml"


@dataclass(kw_only=True)
class GRPOSettings:
    """`grpo.*`: the outer loop."""

    num_prompts_per_step: int = 16
    num_generations_per_prompt: int = 8
    max_steps: int = 100
    val_every: int = 10  # validate before step 0, every N steps and after the last; 0 disables
    val_at_start: bool = True  # the validation before step 0 (NeMo-RL's grpo.val_at_start, verl's val_before_train)
    num_val_prompts: int = 64
    seed: int = 42
    normalize_std: bool = True
    leave_one_out: bool = False
    batch_normalize: bool = False  # REINFORCE++: whiten the advantages over the whole batch (with normalize_std=false)
    advantage_clip: float | None = None
    dynamic_sampling: bool = False  # DAPO: drop zero-variance groups and refill from new prompts
    max_dynamic_sampling_rounds: int = 4
    overlong_filtering: bool = False
    # one step off-policy: step s+1's groups are sampled (and scored) while step s trains, by the weights
    # before step s's update (grpo_app.loop.RolloutQueue); needs generation on its own devices and
    # loss.importance to correct for the one-update lag
    async_rollouts: bool = False

    def __post_init__(self) -> None:
        if self.advantage_clip is not None and self.advantage_clip <= 0:
            raise ConfigError(f"grpo.advantage_clip must be > 0, or null for no clipping; got {self.advantage_clip}")
        if self.num_generations_per_prompt < 2:
            raise ConfigError(
                f"grpo.num_generations_per_prompt must be >= 2 for a group baseline; got "
                f"{self.num_generations_per_prompt}"
            )


@dataclass(kw_only=True)
class GenerationConfig:
    """`generation.*`: the rollout backend and its sampling settings."""

    backend: str = "torch"
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    num_workers: int = 1
    colocated: bool = True  # share devices with training: sleep/wake around each phase
    # verl's hybrid engine: every policy rank hosts its own generation backend and generates its share of
    # the prompts; refit is an in-process copy, and there are no generation actors (one process and one
    # torch import fewer each). YAML `auto` (the default): true on GPUs when colocated (grpo_app.devices).
    in_policy_workers: bool = False
    backend_kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"generation.top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ConfigError(f"generation.top_k={self.top_k} must be >= 0")
        if self.in_policy_workers and self.num_workers != 1:
            logger.warning("generation.num_workers=%d is unused: generation runs inside the policy workers "
                           "(generation.in_policy_workers=true), one generator per policy rank or TP group",
                           self.num_workers)


@dataclass(kw_only=True)
class EnvConfig:
    """`env.*`: the reward environment (rollout.environments) and its prompts."""

    name: str = "repeat_char"
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the environment
    # reward worker actors (each with its own scoring subprocess pool); 0: the driver hosts the environment
    # (its subprocess pool still isolates the reward code), one process less for cheap rewards
    num_workers: int = 1
    # Prompts: local JSONL/Parquet files, a Hugging Face Hub dataset (a name `owner/name`, or the directory `hf
    # download --repo-type dataset` wrote), or (for a built-in task, when unset) the task's own generator.
    train_data: str | None = None
    val_data: str | None = None
    # A Hub dataset's split and subset (the Hub's "config name", GSM8K's main), one pair per dataset since the two may
    # be different datasets: TRL's dataset_train_split / dataset_test_split / dataset_config, NeMo-RL's split / subset.
    # "test": what GSM8K and MATH call their held-out split. A file is one split: set there, they are an error.
    train_split: str = "train"
    val_split: str = "test"
    train_subset: str | None = None
    val_subset: str | None = None
    prompt_key: str = "prompt"
    # the field of the reference answer (metadata "answer"); a dotted path reads nested fields, as verl's data
    # keeps it: reward_model.ground_truth (NeMo-RL's output_key)
    answer_key: str = "answer"
    use_chat_template: bool = False
    system_prompt: str | None = None
    num_generated_train_prompts: int = 4096
    # the run stops when at least this share of one batch's reward calls fail (raise, time out, crash,
    # return None / NaN / a non-number); 1.0: only when all fail, 0.0: at the first failure
    max_failed_reward_fraction: float = 1.0
    prompt_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the built-in prompt generator
    # prompts of more tokens are dropped when loaded, with a warning (verl's filter_overlong_prompts); null:
    # what generation.backend_kwargs.max_model_len leaves for max_new_tokens where that is set, else no limit
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.num_workers < 0:
            raise ConfigError(f"env.num_workers must be >= 0 (0: score in the driver); got {self.num_workers}")
        if not 0.0 <= self.max_failed_reward_fraction <= 1.0:
            raise ConfigError(f"env.max_failed_reward_fraction={self.max_failed_reward_fraction} must be in [0, 1]")
        if self.system_prompt is not None and not self.use_chat_template:  # it would be dropped silently
            raise ConfigError("env.system_prompt is a turn of the chat template, which env.use_chat_template=false "
                              "does not apply; set env.use_chat_template=true, or env.system_prompt= (empty) to drop it")


@dataclass(kw_only=True)
class ClusterConfig:
    """`cluster.*`: where the workers run."""

    address: str | None = None  # join an existing Ray cluster ("auto" or host:port); None starts a local one
    device: Literal["cpu", "cuda"] = "cpu"  # YAML `auto` (the default) resolves in grpo_app.devices
    num_nodes: int = 1
    gpus_per_node: int = 0  # 0: CPU training with gloo; with device cuda on a local run, 0 = every local GPU
    train_world_size: int = 1  # policy ranks = dp x tp x pp x cp
    num_cpus: int | None = None


@dataclass(kw_only=True)
class WandbConfig:
    """`logger.wandb.*`: Weights & Biases, beside metrics.jsonl and TensorBoard (the optional `wandb` extra).
    NeMo-RL's `logger.wandb: {project, name}` in one section, its `wandb_enabled` as `enabled`."""

    enabled: bool = False
    project: str = "grpo"
    name: str | None = None  # the run's display name; default: the name of logger.log_dir
    entity: str | None = None  # the team or user; default: the account's default entity
    tags: list[str] = field(default_factory=list)
    # offline: the run is written to <log_dir>/wandb only (`wandb sync` uploads it later); null: WANDB_MODE, else online
    mode: Literal["online", "offline", "disabled"] | None = None


@dataclass(kw_only=True)
class LoggerConfig:
    log_dir: str = "runs/grpo"
    tensorboard: bool = True
    plot: bool = True
    progress_bar: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass(kw_only=True)
class CheckpointConfig:
    enabled: bool = True
    dir: str | None = None  # default: <logger.log_dir>/checkpoints
    save_every: int = 10
    keep_top_k: int = 2
    metric: str = "val/reward_mean"
    higher_is_better: bool = True
    # a Hugging Face copy of the policy (safetensors + config + tokenizer) in `<checkpoint>/hf`, loadable by
    # transformers and vLLM: in the run's last checkpoint, in every one, or none (`uv run apps/grpo export` later)
    save_hf: Literal["final", "every", "never"] = "final"
    # resume even if policy.model_name, the parallel layout or env.name differ from the checkpoint's (not the engine
    # nor LoRA adapters: their checkpoints cannot load, checkpoint.check_identity)
    allow_config_change: bool = False
    # "[DD:]HH:MM:SS" after the command started (NeMo-RL's checkpoint_must_save_by; a cluster job's time limit less a
    # margin): the run saves a checkpoint and stops once another step would end past it; the same command resumes
    must_save_by: str | None = None

    def __post_init__(self) -> None:
        if self.must_save_by is not None:
            duration_s(self.must_save_by, "checkpointing.must_save_by")
            if not self.enabled:
                raise ConfigError(f"checkpointing.must_save_by={self.must_save_by} stops the run once it has saved a "
                                  "checkpoint: set checkpointing.enabled=true, or remove must_save_by")

    @property
    def must_save_by_s(self) -> int | None:
        """`must_save_by` in seconds (None when unset)."""
        return None if self.must_save_by is None else duration_s(self.must_save_by, "checkpointing.must_save_by")


def duration_s(text: str, key: str) -> int:
    """Seconds of a "[DD:]HH:MM:SS" duration; a ConfigError naming `key` otherwise."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts):
        raise ConfigError(f"{key}={text!r} is not a duration: write HH:MM:SS or DD:HH:MM:SS (e.g. 03:50:00 for a "
                          "4-hour job)")
    return sum(int(p) * unit for p, unit in zip(reversed(parts), (1, 60, 3600, 86400)))


@dataclass(kw_only=True)
class GRPOConfig:
    policy: PolicyConfig
    loss: LossConfig = field(default_factory=LossConfig)
    grpo: GRPOSettings = field(default_factory=GRPOSettings)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpointing: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        for key in ("temperature", "top_k", "top_p"):  # the trainer's logprobs are of the sampler's distribution
            sampled, trained = getattr(self.generation, key), getattr(self.policy, key)
            if sampled != trained:
                raise ConfigError(f"generation.{key}={sampled} but policy.{key}={trained}: the trainer's logprobs "
                                  f"must be of the distribution the sampler draws from; set both to the same value")
        max_model_len = self.generation.backend_kwargs.get("max_model_len")
        if isinstance(max_model_len, int) and max_model_len <= self.generation.max_new_tokens:
            raise ConfigError(f"generation.backend_kwargs.max_model_len={max_model_len} leaves no room for a prompt "
                              f"before generation.max_new_tokens={self.generation.max_new_tokens} new tokens")
        if self.grpo.async_rollouts:
            self._check_async_rollouts()
        samples = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        if samples % self.policy.train_global_batch_size:
            raise ConfigError(
                f"policy.train_global_batch_size={self.policy.train_global_batch_size} must divide the "
                f"samples per step (grpo.num_prompts_per_step x num_generations_per_prompt = {samples})"
            )

    def _check_async_rollouts(self) -> None:
        gen = self.generation
        if gen.colocated or gen.in_policy_workers:
            raise ConfigError(
                f"grpo.async_rollouts=true generates the next step's groups while this step trains, which "
                f"generation.colocated={str(gen.colocated).lower()} / generation.in_policy_workers="
                f"{str(gen.in_policy_workers).lower()} cannot (one side would hold the devices or the process the "
                "other needs): set generation.colocated=false and generation.in_policy_workers=false (generation "
                "workers of their own; on GPUs they take generation.num_workers GPUs after the policy's)")
        if not self.loss.importance.enabled:
            raise ConfigError("grpo.async_rollouts=true trains on groups sampled by the weights one update before; "
                              "set loss.importance.enabled=true, so that importance weights correct for the lag "
                              "(as NeMo-RL's async GRPO requires)")

    @property
    def prompt_token_limit(self) -> int | None:
        """The longest prompt a run keeps: env.max_prompt_tokens, else max_model_len - max_new_tokens; and at
        most what the micro-batch token budget leaves for max_new_tokens, since a longer prompt with a full
        completion fits no micro-batch and would stop the run at the step that sampled it."""
        return self.prompt_token_limit_and_keys[0]

    @property
    def prompt_token_limit_and_keys(self) -> tuple[int | None, str]:
        """`prompt_token_limit` and the config keys (with their values) that set it, for the message of a
        prompt it drops: the user must know which key to raise."""
        new = f"generation.max_new_tokens={self.generation.max_new_tokens}"
        limit, keys = self.env.max_prompt_tokens, f"env.max_prompt_tokens={self.env.max_prompt_tokens}"
        max_model_len = self.generation.backend_kwargs.get("max_model_len")
        if limit is None and max_model_len is not None:
            limit = int(max_model_len) - self.generation.max_new_tokens
            keys = f"generation.backend_kwargs.max_model_len={max_model_len} less {new}"
        budget = longest_planned_sequence(self.policy)
        if budget is not None and (limit is None or budget[1] - self.generation.max_new_tokens < limit):
            limit = budget[1] - self.generation.max_new_tokens
            keys = f"{budget[0]} (a sequence of at most {budget[1]} tokens) less {new}"
        return limit, keys

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.checkpointing.dir or Path(self.logger.log_dir) / "checkpoints")


def longest_planned_sequence(policy: PolicyConfig) -> tuple[str, int] | None:
    """The longest sequence the micro-batch planner accepts in both the training and the logprob passes, and the
    config key (with its value) of the budget that sets it (None: no token budget). seqpack prices a sequence at
    its length rounded up to `round_to`, the lcm of dynamic batching's sequence_length_round and the engine's own
    padding multiple (TP under sequence parallel, megatron's 2 x TP x CP when packing), and refuses one whose
    rounded length exceeds the budget; so the limit is the budget rounded *down* to that multiple. The engine's multiple comes from its class
    (`rl_core.interfaces.PadsSequences`), from the config alone; an engine without it counts as 1."""
    from rl_core.interfaces import PadsSequences
    from rl_core.registry import ENGINES

    if not (policy.sequence_packing.enabled or policy.dynamic_batching.enabled):
        return None  # micro-batches by sequence count: no token budget to overrun
    engine_cls = ENGINES.get(policy.engine_name, config_key=policy.engine_config_key)
    multiple = engine_cls.sequence_multiple(policy) if isinstance(engine_cls, PadsSequences) else 1
    section = "sequence_packing" if policy.sequence_packing.enabled else "dynamic_batching"
    longest = {}
    for training, key in ((True, "train_mb_tokens"), (False, "logprob_mb_tokens")):
        budget = micro_batch_limits(policy, training=training, seq_multiple=multiple)
        tokens, round_to = budget["max_tokens"], budget["round_to"]
        longest[f"policy.{section}.{key}={tokens}"] = tokens // round_to * round_to
    return min(longest.items(), key=lambda item: item[1])


# ---- loading --------------------------------------------------------------------------------------------


def _merge(base: dict, override: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def shipped_or_path(path: str | Path) -> Path:
    """`--config`: a file, or the name of a shipped config (`gpu_1x` or `gpu_1x.yaml`) where no such file is."""
    path = Path(path)
    if path.is_file():
        return path
    return _shipped(path) or path


def _shipped(name: str | Path) -> Path | None:
    """The shipped config a bare name (`gpu_1x`, `gpu_1x.yaml`) stands for, if there is one."""
    name = Path(name)
    if name.parent != Path("."):
        return None
    shipped = CONFIG_DIR / (name.name if name.suffix == ".yaml" else f"{name.name}.yaml")
    return shipped if shipped.is_file() else None


def load_yaml(path: str | Path, _seen: tuple[Path, ...] = (), key_lines: dict[str, str] | None = None) -> dict:
    """Read a YAML config, resolving `defaults: other.yaml` (relative to the file) recursively; `key_lines`, if
    given, receives the `file:line` that sets each dotted key (the last file to set it)."""
    path = Path(path).resolve()
    if path.is_dir() and (path / "config.yaml").is_file():  # a run directory: its resolved config is inside
        raise ConfigError(f"--config {path} is a directory; a run's resolved config is --config {path / 'config.yaml'}")
    if not path.is_file():
        shipped = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        near = closest_key(path.stem, shipped)
        hint = f"did you mean --config {near}? " if near else ""
        raise ConfigError(f"config file {path} does not exist (--config); {hint}shipped configs: "
                          f"{[f'{name}.yaml' for name in shipped]}")
    if path in _seen:
        raise ConfigError(f"config 'defaults:' cycle: {' -> '.join(str(p) for p in (*_seen, path))}")
    try:
        loader = ConfigLoader(path.read_text())
        loader.name = str(path)  # marks (line numbers in errors) name the file
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_error(exc, str(path))) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config sections (policy:, grpo:, ...); "
                          f"got a {type(data).__name__}")
    parents = data.pop("defaults", None)
    merged: dict = {}
    for parent in [parents] if isinstance(parents, str) else parents or []:
        parent_path = path.parent / parent
        if not parent_path.is_file():  # else a shipped config by name, as with --config
            parent_path = _shipped(parent) or parent_path
        if not parent_path.is_file():
            shipped = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
            near = closest_key(Path(parent).stem, shipped)
            raise ConfigError(f"{path}: 'defaults: {parent}' names no file ({path.parent / parent}); paths are "
                              "relative to the file that names them, or the name of a shipped config"
                              f"{f' (did you mean {near}?)' if near else ''}: {shipped}")
        merged = _merge(merged, load_yaml(parent_path, (*_seen, path), key_lines))
    if key_lines is not None:
        _record_key_lines(node, str(path), "", key_lines)
    return _merge(_without_replaced_env_kwargs(merged, data, str(path)), data)


def _without_replaced_env_kwargs(parent: dict, child: dict, child_path: str) -> dict:
    """`parent` without its env.kwargs / env.prompt_kwargs when `child` names another env.name: they belong to the
    parent's environment (cpu_default's repeat_char answer_len would break `function` or `math`), and YAML has no
    way to delete an inherited key. The file's own env.kwargs apply alone; as `env.name=X` on the command line."""
    parent_env, child_env = parent.get("env"), child.get("env")
    if (not isinstance(parent_env, dict) or not isinstance(child_env, dict) or "name" not in child_env
            or child_env["name"] == parent_env.get("name")):
        return parent
    dropped = [section for section in ("kwargs", "prompt_kwargs") if parent_env.get(section)]
    if dropped:
        logger.info("%s: env.name=%s replaces %s: not inheriting %s", child_path, child_env["name"],
                    parent_env.get("name"), ", ".join(f"env.{section} {parent_env[section]}" for section in dropped))
    return {**parent, "env": {k: v for k, v in parent_env.items() if k not in dropped}}


def _record_key_lines(node: yaml.Node, path: str, prefix: str, key_lines: dict[str, str]) -> None:
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                key_lines[prefix + key_node.value] = f"{path}:{key_node.start_mark.line + 1}"
                _record_key_lines(value_node, path, f"{prefix}{key_node.value}.", key_lines)


def _with_file_line(exc: ConfigError, key_lines: dict[str, str]) -> ConfigError:
    """`exc` prefixed with the file and line that set the config key it is about, the first it names, quoted or
    dotted (none for a key that came from the command line)."""
    # a quoted key as the user wrote it (POLICY, +grpo), so a suggestion after it is not taken for it
    first = re.search(r"'([A-Za-z_+~][\w.+~-]*)'|\b([a-z_]+(?:\.[\w-]+)+)", str(exc))
    key = first and (first[1] or first[2])
    return ConfigError(f"{key_lines[key]}: {exc}") if key in key_lines else exc


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `dotted.key=value` (value parsed as YAML) in place; unknown paths fail at validation."""
    if "=" not in assignment:
        raise ConfigError(f"override {assignment!r} is not of the form dotted.key=value; give each override as one "
                          "argument, without spaces around '=' (grpo.max_steps=5; quote a value with spaces: "
                          "'env.system_prompt=Be brief.')")
    dotted, raw = assignment.split("=", 1)
    if dotted.startswith(("+", "~")):
        bare = dotted.lstrip("+~")
        raise ConfigError(f"override {assignment!r}: '{dotted[: len(dotted) - len(bare)]}' is Hydra's syntax; here "
                          f"every key is set the same way, whether the config file has it or not: {bare}={raw}")
    keys = dotted.strip().split(".")
    node = data
    for depth, key in enumerate(keys[:-1]):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted!r}: '{'.'.join(keys[: depth + 1])}' is a value, not a section")
        node = child
    value = parse_value(raw, dotted.strip())
    old = node.get(keys[-1])
    if isinstance(old, dict) and isinstance(value, dict) and set(old) - set(value):
        logger.warning("%s={...} replaces the whole mapping: dropping %s (to change one entry, override "
                       "%s.<key>=value)", dotted.strip(), sorted(set(old) - set(value)), dotted.strip())
    node[keys[-1]] = value


def parse_value(raw: str, key: str = "value") -> Any:
    """A command-line value as YAML, read as in the config files (grpo_app.config_yaml: `3e-4` a number, `010` the
    string '010'); a quoted value is a string."""
    if not raw.strip():
        return None
    try:
        return yaml.load(raw, Loader=ConfigLoader)  # a SafeLoader, as for the files
    except ConfigError as exc:  # a duplicate key in an inline mapping
        raise ConfigError(f"override {key}={raw}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}={raw} is {yaml_error(exc, None)}; close its brackets and quotes, or "
                          f"quote the whole value as a YAML string ({key}='\"...\"')") from None


def load_config(path: str | Path | None = None, overrides: list[str] = (),
                hardware: Hardware | None = None) -> GRPOConfig:
    """The validated config from a YAML file (default: the CPU default) plus dotted overrides, with every
    `auto` resolved for `hardware` (default: this machine's) and the refit layout checked."""
    key_lines: dict[str, str] = {}
    data = load_yaml(shipped_or_path(path) if path else DEFAULT_CONFIG, key_lines=key_lines)
    file_env = copy.deepcopy(data.get("env")) if isinstance(data.get("env"), dict) else {}
    for assignment in overrides:
        apply_override(data, assignment)
        dotted = assignment.split("=", 1)[0].strip()  # now set on the command line, not in a file
        key_lines = {k: v for k, v in key_lines.items() if k != dotted and not k.startswith(dotted + ".")}
    data = resolve_bool_words(data, GRPOConfig)  # before anything reads a switch (resolve_auto reads some raw)
    _reset_env_kwargs(data, file_env, overrides)
    try:
        check_schema_keys(GRPOConfig, data)  # a typo answers before the hardware is probed (a subprocess on a GPU)
        cfg = parse_config(GRPOConfig, resolve_auto(data, hardware or detect_hardware()))
    except UnknownKeyError as exc:
        raise _with_file_line(explain_unknown_key(exc, data, GRPOConfig), key_lines) from None
    except ConfigError as exc:
        if path and "defaults" not in key_lines and "is required" in str(exc):  # a file written from scratch
            exc = ConfigError(f"{exc} (--config {path} names no 'defaults:', so it starts from the schema's defaults "
                              "alone; add 'defaults: cpu_default' to it to start from the embedded default run)")
        raise _with_file_line(exc, key_lines) from None
    from grpo_app.refit import refit_path  # torch: not needed to find a config's own errors

    refit_path(cfg)  # a placement that cannot work fails here, naming the keys
    return cfg


def _reset_env_kwargs(data: dict, file_env: dict, overrides: list[str]) -> None:
    """`env.name=X` on the command line drops the file's env.kwargs / env.prompt_kwargs, which belong to the
    file's environment (repeat_char's answer_len would break `math`); those set on the command line stay."""
    env = data.get("env")
    if not isinstance(env, dict) or "name" not in file_env or env.get("name") == file_env["name"]:
        return
    for section in ("kwargs", "prompt_kwargs"):
        given = {o.split("=", 1)[0].strip().split(".")[2] for o in overrides if o.startswith(f"env.{section}.")}
        if any(o.startswith(f"env.{section}=") for o in overrides) or not isinstance(env.get(section), dict):
            continue
        dropped = {k: v for k, v in file_env.get(section, {}).items() if k not in given}
        if dropped:
            logger.info("env.name=%s replaces %s: dropping the file's env.%s %s", env["name"], file_env["name"],
                        section, dropped)
            env[section] = {k: v for k, v in env[section].items() if k not in dropped}
