"""YAML loading, `defaults:` inheritance, dotted overrides and validation errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_app.config import CONFIG_DIR, apply_override, load_config, load_yaml
from grpo_app.devices import Hardware
from rl_core.config import ConfigError
from rl_core.interfaces import ValidatesConfig
from rl_core.registry import ENGINES


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_defaults_inheritance_and_overrides(tmp_path):
    write(tmp_path / "base.yaml", "policy:\n  model_name: m\n  optimizer: {name: AdamW, kwargs: {lr: 1.0e-5}}\n"
                                  "grpo: {max_steps: 7, num_prompts_per_step: 4}\n")
    child = write(tmp_path / "child.yaml", "defaults: base.yaml\ngrpo: {max_steps: 9}\n")
    cfg = load_config(child, ["grpo.num_generations_per_prompt=4", "policy.optimizer.kwargs.lr=3e-4",
                              "policy.train_global_batch_size=16"])
    assert cfg.grpo.max_steps == 9 and cfg.grpo.num_prompts_per_step == 4
    assert cfg.policy.optimizer.kwargs["lr"] == 3e-4 and cfg.policy.optimizer.name == "AdamW"
    assert cfg.grpo.num_generations_per_prompt == 4


def test_unknown_key_names_the_nearest(tmp_path):
    path = write(tmp_path / "c.yaml", "policy: {model_name: m}\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'grpo.max_step'.*did you mean 'grpo.max_steps'"):
        load_config(path, ["grpo.max_step=3"])
    with pytest.raises(ConfigError, match=r"unknown config key 'polcy'.*did you mean 'policy'"):
        load_config(path, ["polcy.model_name=x"])


def test_every_unknown_key_of_a_section_is_named_in_one_error(tmp_path):
    path = write(tmp_path / "c.yaml", "policy: {model_name: m}\ngrpo: {max_step: 3, sed: 1, seed: 2}\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: unknown config key 'grpo.max_step'; did you mean 'grpo.max_steps'\? "
                                          r"Also unknown here: 'grpo.sed' \(did you mean 'grpo.seed'\?\)\. Valid keys"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"^unknown config key 'polcy'; did you mean 'policy'\? Also unknown here: "
                                          r"'genration' \(did you mean 'generation'\?\)\."):
        load_config(None, ["polcy.model_name=x", "genration.top_k=3"])


def test_unknown_keys_of_several_sections_are_one_error_found_before_the_hardware_is_probed(monkeypatch):
    """A typo in `policy` and one in `grpo` were two runs, and each was reported after the device line: the keys were
    checked section by section as the values were read, after the hardware probe (a subprocess on a GPU machine)."""
    def no_probe() -> Hardware:
        raise AssertionError("the hardware was probed before the keys were checked")

    monkeypatch.setattr("grpo_app.config.detect_hardware", no_probe)
    with pytest.raises(ConfigError, match=r"^unknown config key 'policy.optimizer.lrr'\..* Valid keys here: "
                                          r"\['kwargs', 'name'\]\. Unknown in other sections too: 'loss.kl_cof' "
                                          r"\(did you mean 'loss.kl_coef'\?\), 'loss.eps_hi' \(did you mean "
                                          r"'loss.eps_high'\?\), 'grpo.max_stepz' \(did you mean 'grpo.max_steps'\?\)$"):
        load_config(None, ["policy.optimizer.lrr=1", "grpo.max_stepz=5", "loss.kl_cof=0.1", "loss.eps_hi=0.3"])
    with pytest.raises(AssertionError, match="probed"):  # the probe is there to be reached, once the keys are known
        load_config(None, ["grpo.max_steps=5"])


def test_a_key_of_another_section_is_suggested_where_its_level_has_none(tmp_path):
    path = write(tmp_path / "c.yaml", "policy: {model_name: m}\n")
    with pytest.raises(ConfigError, match=r"^unknown config key 'policy.lr'; did you mean 'policy.optimizer.kwargs.lr'\?"):
        load_config(path, ["policy.lr=1e-3"])
    with pytest.raises(ConfigError, match=r"^unknown config key 'loss.temperature'; did you mean 'policy.temperature' "
                                          r"or 'generation.temperature'\?"):
        load_config(path, ["loss.temperature=0.7"])


def test_hydra_prefixes_and_a_misspelt_section_from_the_command_line(tmp_path):
    """`+grpo.max_steps=5` (Hydra's syntax) was an unknown key '+grpo' reported at the line of the default config that
    sets 'grpo', where the user wrote nothing; `POLICY.x` the same for 'policy'."""
    with pytest.raises(ConfigError, match=r"^override '\+\+grpo.max_steps=5': '\+\+' is Hydra's syntax; here every key "
                                          r"is set the same way, whether the config file has it or not: grpo.max_steps=5$"):
        load_config(None, ["++grpo.max_steps=5"])
    with pytest.raises(ConfigError, match=r"^unknown config key 'POLICY'.*did you mean 'policy'"):  # no file:line
        load_config(None, ["POLICY.max_grad_norm=1"])


def test_wrong_type_is_named(tmp_path):
    path = write(tmp_path / "c.yaml", "policy: {model_name: m}\n")
    with pytest.raises(ConfigError, match=r"'grpo.max_steps' must be an integer; got str 'many'"):
        load_config(path, ["grpo.max_steps=many"])


def test_cross_field_checks(tmp_path):
    path = write(tmp_path / "c.yaml", "policy: {model_name: m}\n")
    with pytest.raises(ConfigError, match="policy.temperature"):
        load_config(path, ["generation.temperature=0.7"])
    for sampling in ("top_k=20", "top_p=0.9"):  # top-k / top-p truncate the distribution the trainer recomputes
        with pytest.raises(ConfigError, match=f"generation.{sampling} but policy.{sampling.split('=')[0]}"):
            load_config(path, [f"generation.{sampling}"])
        assert load_config(path, [f"generation.{sampling}", f"policy.{sampling}"]).policy.top_k in (0, 20)
    with pytest.raises(ConfigError, match="train_global_batch_size"):
        load_config(path, ["policy.train_global_batch_size=7"])
    with pytest.raises(ConfigError, match="NCCL refuses two ranks on one device"):
        load_config(path, ["cluster.device=cuda", "generation.in_policy_workers=false"],
                    hardware=Hardware(cuda_available=True, bf16_supported=True, num_gpus=1))
    with pytest.raises(ConfigError, match=r"env.num_workers must be >= 0"):
        load_config(path, ["env.num_workers=-1"])
    for bad, key in [("policy.max_grad_norm=0", "policy.max_grad_norm must be > 0, or null"),
                     ("policy.max_grad_norm=-1", "policy.max_grad_norm must be > 0, or null"),
                     ("loss.kl_coef=-0.1", "loss.kl_coef must be >= 0"),
                     ("grpo.advantage_clip=0", "grpo.advantage_clip must be > 0, or null"),
                     ("policy.dynamic_batching.enabled=true", "sequence_packing.enabled and policy.dynamic_batching"
                                                              ".enabled are exclusive")]:
        with pytest.raises(ConfigError, match=key):
            load_config(path, ["policy.sequence_packing.enabled=true", bad])
    # checked even with importance sampling off: the loss reports the IS metrics within these bounds
    with pytest.raises(ConfigError, match=r"loss.importance needs 0 <= low <= high; got low=3.0, high=2.0"):
        load_config(path, ["loss.importance.low=3.0"])


def test_system_prompt_without_the_chat_template_is_refused(tmp_path):
    """A plain prompt is the text itself: a system prompt would be dropped without a word."""
    path = write(tmp_path / "c.yaml", "policy: {model_name: m}\n")
    with pytest.raises(ConfigError, match=r"env.system_prompt .*env.use_chat_template=false does not apply"):
        load_config(path, ["env.system_prompt=Be brief."])
    assert load_config(path, ["env.system_prompt=Be brief.", "env.use_chat_template=true"]).env.system_prompt == "Be brief."
    base = CONFIG_DIR / "gpu_base.yaml"  # sets a system prompt: dropping the template needs dropping it too
    assert load_config(base, ["env.use_chat_template=false", "env.system_prompt="]).env.system_prompt is None


def test_defaults_cycle_and_missing_file(tmp_path):
    write(tmp_path / "a.yaml", "defaults: b.yaml\n")
    write(tmp_path / "b.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_yaml(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_yaml(tmp_path / "missing.yaml")
    child = write(tmp_path / "child.yaml", "defaults: gone.yaml\n")
    with pytest.raises(ConfigError, match=rf"{child}: 'defaults: gone.yaml' names no file"):
        load_yaml(child)


def test_generator_count_unused_in_policy_workers_is_a_warning(tmp_path, caplog):
    path = write(tmp_path / "c.yaml", "policy: {model_name: m}\n")
    with caplog.at_level("WARNING"):
        load_config(path, ["generation.in_policy_workers=true", "generation.num_workers=3"])
    assert "generation.num_workers=3 is unused" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_config(path, ["generation.in_policy_workers=false", "generation.num_workers=3"])
    assert "is unused" not in caplog.text


def test_config_by_shipped_name(tmp_path, monkeypatch):
    """`--config gpu_1x` (or gpu_1x.yaml) is the shipped recipe where no such file exists; a file wins."""
    monkeypatch.chdir(tmp_path)
    shipped = load_config(CONFIG_DIR / "cpu_megatron.yaml")
    assert load_config("cpu_megatron") == shipped == load_config("cpu_megatron.yaml")
    assert shipped.policy.engine_name == "megatron"
    write(tmp_path / "cpu_megatron.yaml", "defaults: " + str(CONFIG_DIR / "cpu_default.yaml") + "\n")
    assert load_config("cpu_megatron.yaml").policy.engine_name == "dtensor"
    with pytest.raises(ConfigError, match=r"nope does not exist \(--config\); shipped configs: \[.*'gpu_1x.yaml'"):
        load_config("nope")


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_override({}, "grpo.max_steps")
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_override({"grpo": 3}, "grpo.max_steps=1")


def test_every_shipped_config_validates():
    """Each recipe parses into GRPOConfig and its engine accepts its engine section (TransformerConfig keys too)."""
    configs = sorted(CONFIG_DIR.glob("*.yaml"))
    assert len(configs) >= 9
    engines = set()
    for path in configs:
        cfg = load_config(path)
        engine_cls = ENGINES.get(cfg.policy.engine_name, config_key="policy")
        assert isinstance(engine_cls, ValidatesConfig)
        engine_cls.validate_config(cfg.policy)
        engines.add(cfg.policy.engine_name)
    assert engines == {"dtensor", "megatron"}


def test_megatron_switch_is_one_key():
    cfg = load_config(None, ["policy.megatron_cfg.enabled=true"])
    assert cfg.policy.engine_name == "megatron"
    with pytest.raises(ConfigError, match="unknown config key 'policy.megatron_cfg.tensor_model_paralel_size'"):
        ENGINES.get("megatron", config_key="policy").validate_config(
            load_config(None, ["policy.megatron_cfg.enabled=true",
                               "policy.megatron_cfg.tensor_model_paralel_size=2"]).policy)


def test_prompt_limit_rounds_by_the_engines_padding_multiple():
    """seqpack prices a sequence at its length rounded up to the lcm of sequence_length_round and the engine's
    own multiple, and refuses it past the budget. The limit used to round by sequence_length_round alone, so
    it admitted prompts whose prompt + max_new_tokens the engine's planner then refused mid-run."""
    import torch

    import seqpack
    from engine_dtensor.config import DTensorConfig
    from engine_megatron import batching
    from engine_megatron.config import parse_megatron_config, resolve_settings
    from grpo_app.config import longest_planned_sequence
    from rl_core.batch import TokenBatch
    from rl_core.config import micro_batch_limits
    from rl_core.testing.tiny_models import tiny_config

    base = ["policy.model_name=x", "generation.max_new_tokens=64"]
    # DTensor, TP=3 with sequence parallel, dynamic batching: round_to = lcm(64, 3) = 192
    dtensor = load_config(None, [*base, "policy.sequence_packing.enabled=false", "policy.dynamic_batching.enabled=true",
                                 "policy.dynamic_batching.train_mb_tokens=1100",
                                 "policy.dtensor_cfg.tensor_parallel_size=3", "policy.dtensor_cfg.sequence_parallel=true"])
    # 5 x 192; the old limit, 1100 // 64 * 64, was 1088
    assert longest_planned_sequence(dtensor.policy) == ("policy.dynamic_batching.train_mb_tokens=1100", 960)
    assert dtensor.prompt_token_limit == 960 - 64
    # what DTensorEngine._plan asks seqpack for (no process group: plan_dp_micro_batches is plan_micro_batches)
    limits = micro_batch_limits(dtensor.policy, training=True, seq_multiple=DTensorConfig.from_policy(dtensor.policy)
                                .seq_multiple)
    seqpack.plan_dp_micro_batches([960], **limits)
    with pytest.raises(ValueError, match=r"length 1088 \(1152 after round_to=192\) > max_tokens=1100"):
        seqpack.plan_dp_micro_batches([1088], **limits)

    # Megatron, TP=2 (sequence parallel on by default), packing: every packed sequence padded to 2 x TP = 4
    megatron = load_config(None, [*base, "policy.megatron_cfg.enabled=true",
                                  "policy.megatron_cfg.tensor_model_parallel_size=2",
                                  "policy.sequence_packing.train_mb_tokens=1026"])
    # the old limit was the budget itself, 1026
    assert longest_planned_sequence(megatron.policy) == ("policy.sequence_packing.train_mb_tokens=1026", 1024)
    assert megatron.prompt_token_limit == 1024 - 64
    policy = megatron.policy
    settings = resolve_settings(policy, parse_megatron_config(policy.engine_options), tiny_config("qwen2"),
                                world_size=2, use_cuda=False)

    def batch(length: int) -> TokenBatch:
        return TokenBatch(input_ids=[torch.zeros(length, dtype=torch.long)], loss_mask=[torch.ones(length)])

    batching.plan(batch(1024), policy, settings, training=True)
    with pytest.raises(ValueError, match=r"length 1026 \(1028 after round_to=4\) > max_tokens=1026"):
        batching.plan(batch(1026), policy, settings, training=True)


# ---- the mistakes new users make: each one line naming the key, the file and line, and the fix ----------


def test_exponent_without_a_dot_is_a_number_in_files_and_overrides(tmp_path):
    """YAML 1.1 (PyYAML) reads `3e-4` as a string; the trainer's YAML reads it as the number it means."""
    path = write(tmp_path / "c.yaml", "policy:\n  model_name: m\n  optimizer: {kwargs: {lr: 3e-4}}\n"
                                      "  scheduler: {min_lr_ratio: 1E-2}\n")
    cfg = load_config(path)
    assert cfg.policy.optimizer.kwargs["lr"] == 3e-4 and cfg.policy.scheduler.min_lr_ratio == 1e-2
    assert load_config(path, ["policy.optimizer.kwargs={lr: 1e-4}"]).policy.optimizer.kwargs == {"lr": 1e-4}
    assert load_config(path, ["logger.log_dir=e5"]).logger.log_dir == "e5"  # still a string


def test_config_naming_a_run_directory_points_at_its_config_yaml(tmp_path):
    (tmp_path / "config.yaml").write_text("defaults: cpu_default\n")
    with pytest.raises(ConfigError, match=rf"--config {tmp_path} is a directory; a run's resolved config is "
                                          rf"--config {tmp_path}/config.yaml"):
        load_config(tmp_path)


def test_a_quoted_override_stays_a_string(tmp_path):
    """As the README says (quote a value YAML would read otherwise), and as in a file: "42" and '1e5' are strings
    (they became the numbers 42 and 100000.0, which a str key refused)."""
    cfg = load_config(None, ['env.system_prompt="42"', "env.use_chat_template=true", "logger.log_dir='1e5'",
                             "grpo.max_steps=7"])
    assert cfg.env.system_prompt == "42" and cfg.logger.log_dir == "1e5" and cfg.grpo.max_steps == 7


def test_yaml_syntax_error_is_one_line_naming_file_line_and_column(tmp_path):
    tab = write(tmp_path / "tab.yaml", "policy:\n  model_name: m\ngrpo:\n\tmax_steps: 5\n")
    with pytest.raises(ConfigError) as err:
        load_yaml(tab)
    assert str(err.value) == (f"{tab}:4:1: not valid YAML: found character '\\t' that cannot start any token; "
                              "indent with spaces, not tabs")
    bracket = write(tmp_path / "bracket.yaml", "policy:\n  model_name: m\ngrpo: {max_steps: 5\n")
    with pytest.raises(ConfigError, match=rf"^{bracket}:4:1: not valid YAML: .*\(while parsing a flow mapping on "
                                          r"line 3\)$"):
        load_yaml(bracket)


def test_override_that_is_not_valid_yaml_is_a_config_error():
    """An unclosed bracket or quote on the command line: one line naming the override, not a yaml traceback."""
    with pytest.raises(ConfigError, match=r"override policy.optimizer.kwargs.betas=\[0.9, 0.95 is not valid YAML at "
                                          r"column 11: .*close its brackets and quotes"):
        apply_override({}, "policy.optimizer.kwargs.betas=[0.9, 0.95")
    with pytest.raises(ConfigError, match=r"override env.kwargs=\{a: 1, a: 2\}: .*duplicate key 'a'"):
        apply_override({}, "env.kwargs={a: 1, a: 2}")


def test_override_with_spaces_around_the_equals_sign_says_so():
    """`grpo.max_steps = 5` reaches the trainer as three arguments."""
    with pytest.raises(ConfigError, match=r"override 'grpo.max_steps' is not of the form dotted.key=value; give each "
                                          r"override as one argument, without spaces around '='"):
        load_config(None, ["grpo.max_steps", "=", "5"])


def test_mapping_override_replaces_the_mapping_and_says_what_it_drops(tmp_path, caplog):
    path = write(tmp_path / "c.yaml", "policy:\n  model_name: m\n  optimizer: {kwargs: {lr: 1.0e-3, betas: [0.9, "
                                      "0.99], weight_decay: 0.0}}\n")
    with caplog.at_level("WARNING", logger="grpo_app.config"):
        cfg = load_config(path, ["policy.optimizer.kwargs={lr: 2.0e-3}"])
    assert cfg.policy.optimizer.kwargs == {"lr": 2e-3}
    assert ("policy.optimizer.kwargs={...} replaces the whole mapping: dropping ['betas', 'weight_decay'] (to change "
            "one entry, override policy.optimizer.kwargs.<key>=value)") in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo_app.config"):
        cfg = load_config(path, ["policy.optimizer.kwargs.lr=2.0e-3", "policy.optimizer.kwargs.betas=[0.9,0.95]"])
    assert cfg.policy.optimizer.kwargs == {"lr": 2e-3, "betas": [0.9, 0.95], "weight_decay": 0.0}
    assert "replaces" not in caplog.text


def test_unknown_config_name_suggests_the_closest_shipped_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"gpu1x does not exist \(--config\); did you mean --config gpu_1x\?"):
        load_config("gpu1x")


def test_string_where_a_mapping_was_read_hints_at_quoting():
    """`env.system_prompt=Answer: briefly` is a YAML mapping; the error says to quote it."""
    with pytest.raises(ConfigError, match=r"must be a str; got dict \{'Answer': 'briefly'\} \(YAML reads an unquoted "
                                          r"'a: b' as a mapping"):
        load_config(None, ["env.system_prompt=Answer: briefly", "env.use_chat_template=true"])
    cfg = load_config(None, ['env.system_prompt="Answer: briefly"', "env.use_chat_template=true"])
    assert cfg.env.system_prompt == "Answer: briefly"


def test_a_bad_key_or_value_in_a_file_names_the_file_and_line(tmp_path):
    """Errors about a key a YAML file sets start with that file and line (the child's, where both set it); a key
    set on the command line has no file to name."""
    base = write(tmp_path / "base.yaml", "policy: {model_name: m}\ngrpo:\n  max_steps: 3\n  seed: x\n")
    child = write(tmp_path / "child.yaml", "defaults: base.yaml\n\ngrpo:\n  max_step: 5\n  seed: y\n")
    with pytest.raises(ConfigError, match=rf"^{child}:4: unknown config key 'grpo.max_step'; did you mean "
                                          r"'grpo.max_steps'\?"):
        load_config(child)
    with pytest.raises(ConfigError, match=rf"^{base}:4: 'grpo.seed' must be an integer; got str 'x'$"):
        load_config(base)
    with pytest.raises(ConfigError, match=r"^'grpo.seed' must be an integer; got str 'z'$"):  # overridden
        load_config(base, ["grpo.seed=z"])
    with pytest.raises(ConfigError, match=r"^unknown config key 'grpo.max_stepz'"):  # its suggestion is in base.yaml
        load_config(base, ["grpo.seed=1", "grpo.max_stepz=5"])
    child2 = write(tmp_path / "child2.yaml", "defaults: base.yaml\ngrpo: {seed: y}\n")
    with pytest.raises(ConfigError, match=rf"^{child2}:2: 'grpo.seed' must be an integer; got str 'y'$"):
        load_config(child2)


def test_defaults_may_name_a_shipped_config(tmp_path):
    """A user's file next to nothing else inherits a shipped config by name, as --config takes one."""
    mine = write(tmp_path / "mine.yaml", "defaults: cpu_default\ngrpo: {max_steps: 2}\n")
    cfg = load_config(mine)
    assert cfg.grpo.max_steps == 2 and cfg.policy.model_name == load_config(CONFIG_DIR / "cpu_default.yaml").policy.model_name
    typo = write(tmp_path / "typo.yaml", "defaults: cpu_defaults.yaml\n")
    with pytest.raises(ConfigError, match=r"'defaults: cpu_defaults.yaml' names no file .*or the name of a shipped "
                                          r"config \(did you mean cpu_default\?\)"):
        load_config(typo)


def test_a_file_without_defaults_says_how_to_start_from_the_default_run(tmp_path):
    """A file written from scratch (as for verl or NeMo-RL) inherits nothing: the missing required key is named
    with the fix, where it said `is required (<class 'str'>)`."""
    own = tmp_path / "mine.yaml"
    own.write_text("grpo:\n  max_steps: 2\n")
    with pytest.raises(ConfigError) as exc:
        load_config(own)
    assert str(exc.value) == (f"config key 'policy.model_name' is required (str); set it (--config {own} names no "
                              "'defaults:', so it starts from the schema's defaults alone; add 'defaults: cpu_default' "
                              "to it to start from the embedded default run)")
    own.write_text("defaults: cpu_default\ngrpo:\n  max_steps: 2\n")
    assert load_config(own).grpo.max_steps == 2


# ---- YAML 1.1 readings that changed a value's meaning (grpo_app.config_yaml) ---------------------------------


def test_numbers_are_read_as_yaml_1_2_and_python_read_them(tmp_path):
    """PyYAML (YAML 1.1) read `charset=0123` as the octal 83, `seed=010` as 8 (and `seed=08` as 8 through a fallback),
    `1:30` as 90 and `2024-01-01` as a date. Now digits with a leading zero, base-60 and dates keep their text, and a
    number key given a leading zero is an error naming both readings; `1_000`, `0x1f`, `0o17` are the integers they
    are in Python, and `1e-5` a float."""
    cfg = load_config(None, ["env.prompt_kwargs.charset=0123", "env.kwargs.zeros=007", "env.kwargs.clock=1:30",
                             "env.kwargs.day=2024-01-01", "env.kwargs.big=1_000", "env.kwargs.hex=0x1f",
                             "env.kwargs.octal=0o17", "env.kwargs.lr=1e-5", "env.kwargs.half=.5", "grpo.seed=1_000"])
    assert cfg.env.prompt_kwargs["charset"] == "0123" and cfg.grpo.seed == 1000
    kwargs = {k: v for k, v in cfg.env.kwargs.items() if k in ("zeros", "clock", "day", "big", "hex", "octal", "lr", "half")}
    assert kwargs == {"zeros": "007", "clock": "1:30", "day": "2024-01-01", "big": 1000, "hex": 31, "octal": 15,
                      "lr": 1e-05, "half": 0.5}
    assert [type(kwargs[k]) for k in ("big", "lr", "half")] == [int, float, float]
    with pytest.raises(ConfigError, match=r"^'grpo.seed' must be an integer; got str '010' \(a leading zero is "
                                          r"ambiguous: YAML 1.1 reads 010 as the octal 8, YAML 1.2 as 10; write 10, or "
                                          r"0o10 for the octal 8\)$"):
        load_config(None, ["grpo.seed=010"])
    with pytest.raises(ConfigError, match=r"^'grpo.seed' must be an integer; got str '08' \(write 8, without the "
                                          r"leading zero\)$"):
        load_config(None, ["grpo.seed=08"])
    with pytest.raises(ConfigError, match=r"'grpo.num_val_prompts' must be an integer; got str '1:04' \(YAML 1.1 "
                                          r"reads 1:04 as a base-60 number"):
        load_config(None, ["grpo.num_val_prompts=1:04"])
    path = write(tmp_path / "c.yaml", "defaults: cpu_default\nenv:\n  prompt_kwargs: {charset: 0123}\n"
                                      "grpo:\n  seed: 010\n")
    with pytest.raises(ConfigError, match=rf"^{path}:5: 'grpo.seed' must be an integer; got str '010' \(a leading zero"):
        load_config(path)
    path.write_text("defaults: cpu_default\nenv:\n  prompt_kwargs: {charset: 0123}\ngrpo:\n  seed: 10\n")
    assert load_config(path).env.prompt_kwargs["charset"] == "0123"


def test_yes_no_on_off_are_text_for_a_string_key_and_booleans_elsewhere(tmp_path):
    """`env.system_prompt=yes` was the boolean True, refused as no string, and `logger.wandb.tags=[on]` the same; a
    mapping key `on` was True. A string key now keeps the word; a bool key, and the free-form mappings (env.kwargs,
    the engine sections, where the string 'off' would be true), read it as YAML 1.1 does, also in resolve_auto, which
    reads generation.colocated before validation."""
    cfg = load_config(None, ["env.use_chat_template=true", "env.system_prompt=yes", "logger.wandb.tags=[on, No]",
                             "logger.wandb.name=OFF", "checkpointing.enabled=off", "checkpointing.save_hf=never",
                             "grpo.normalize_std=no", "env.kwargs.flag=off", "env.kwargs.word='off'",
                             "env.kwargs.nested={on: [yes, 'no']}", "policy.dtensor_cfg.enabled=on"])
    assert (cfg.env.system_prompt, cfg.logger.wandb.tags, cfg.logger.wandb.name) == ("yes", ["on", "No"], "OFF")
    assert (cfg.checkpointing.enabled, cfg.grpo.normalize_std, cfg.policy.dtensor_cfg["enabled"]) == (False, False, True)
    assert cfg.env.kwargs["flag"] is False and cfg.env.kwargs["word"] == "off"
    assert cfg.env.kwargs["nested"] == {"on": [True, "no"]}
    path = write(tmp_path / "c.yaml", "defaults: cpu_default\nenv: {use_chat_template: true, system_prompt: no}\n"
                                      "logger: {wandb: {tags: [yes]}}\n")
    file_cfg = load_config(path)
    assert file_cfg.env.system_prompt == "no" and file_cfg.logger.wandb.tags == ["yes"]
    gpu = Hardware(cuda_available=True, bf16_supported=True, num_gpus=2)
    assert load_config(None, ["generation.colocated=off"], hardware=gpu).generation.in_policy_workers is False
    assert load_config(None, ["generation.colocated=on"], hardware=gpu).generation.in_policy_workers is True


def test_a_file_may_merge_an_anchored_mapping(tmp_path):
    """`<<: *anchor` (YAML's merge key) failed as 'could not determine a constructor for the tag ...merge': the
    duplicate-key check constructed every key, the merge key too. Merged keys may be overridden; a key given twice
    beside it is still refused."""
    path = write(tmp_path / "c.yaml", "x-opt: &opt {lr: 1.0e-4, weight_decay: 0.1}\n"
                                      "policy:\n  optimizer:\n    kwargs: {<<: *opt, lr: 2.0e-4}\n")
    data = load_yaml(path)
    assert data["policy"]["optimizer"]["kwargs"] == {"lr": 2.0e-4, "weight_decay": 0.1}
    path.write_text("x-opt: &opt {lr: 1.0e-4}\nkwargs: {<<: *opt, lr: 2.0e-4, lr: 3.0e-4}\n")
    with pytest.raises(ConfigError, match=r"c.yaml:2: duplicate key 'lr'"):
        load_yaml(path)


def test_must_save_by_is_a_duration_and_needs_checkpoints():
    assert load_config(None, ["checkpointing.must_save_by=01:02:03:04"]).checkpointing.must_save_by_s == (
        86400 + 2 * 3600 + 3 * 60 + 4)
    with pytest.raises(ConfigError, match=r"checkpointing.must_save_by='4h' is not a duration: write HH:MM:SS or "
                                          r"DD:HH:MM:SS"):
        load_config(None, ["checkpointing.must_save_by=4h"])
    with pytest.raises(ConfigError, match=r"stops the run once it has saved a checkpoint: set "
                                          r"checkpointing.enabled=true"):
        load_config(None, ["checkpointing.must_save_by=03:50:00", "checkpointing.enabled=false"])
