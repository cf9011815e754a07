"""Configs in NeMo-RL's, verl's and TRL's names (grpo_app.ported_configs): each gets its whole port in one error, and
each port is checked against one written by hand, which loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from grpo_app.config import apply_override, load_config, load_yaml
from grpo_app.preflight import preflight
from rl_core.config import ConfigError


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _flatten(data: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


NEMO_RL_STYLE = """\
policy:
  model_name: m
  optimizer: {name: torch.optim.AdamW, kwargs: {lr: 3.0e-6}}
  generation: {max_new_tokens: 24, temperature: 1.0}
grpo: {max_num_steps: 7, val_period: 5, use_leave_one_out_baseline: true, normalize_rewards: false}
loss_fn: {reference_policy_kl_penalty: 0.01, ratio_clip_min: 0.1, ratio_clip_max: 0.28}
checkpointing: {checkpoint_dir: ckpts, save_period: 3}
logger: {tensorboard_enabled: false}
"""


def test_a_config_in_nemo_rls_names_gets_every_rename_in_one_error_and_loads_once_renamed(tmp_path):
    """A NeMo-RL config brought over failed on one unknown key per run, some with no suggestion (difflib finds no
    'val_every' near 'val_period'). Now one error lists every key with its name here, and renaming by that list
    alone gives a config that loads, each value where it belongs."""
    path = write(tmp_path / "nemo.yaml", NEMO_RL_STYLE)
    with pytest.raises(ConfigError, match="This config uses NeMo-RL's names") as raised:
        load_config(path)
    assert "\n" not in str(raised.value)  # nothing but renames to make
    listed = dict(pair.split(" -> ") for pair in str(raised.value).split("here they are spelled: ")[1].split(", "))
    assert len(listed) == 12, listed
    data = load_yaml(path)
    renamed: dict = {}
    for key, value in _flatten(data).items():
        apply_override(renamed, f"{listed.get(key, key)}={value}")
    cfg = load_config(write(tmp_path / "ours.yaml", yaml.safe_dump(renamed)))
    assert (cfg.grpo.max_steps, cfg.grpo.val_every, cfg.grpo.leave_one_out, cfg.grpo.normalize_std) == (7, 5, True, False)
    assert (cfg.loss.kl_coef, cfg.loss.eps_low, cfg.loss.eps_high) == (0.01, 0.1, 0.28)
    assert (cfg.checkpointing.dir, cfg.checkpointing.save_every, cfg.logger.tensorboard) == ("ckpts", 3, False)
    assert cfg.generation.max_new_tokens == 24 and cfg.policy.optimizer.name == "AdamW"


NEMO_RL_PORT = """\
policy:
  model_name: m
  max_total_sequence_length: 40
  tokenizer: {name: m}
  megatron_cfg: {enabled: false, converter_type: Qwen2ForCausalLM}
  sequence_packing: {enabled: true, algorithm: modified_first_fit_decreasing, sequence_length_round: 64}
  generation:
    max_new_tokens: ${policy.max_total_sequence_length}
    top_k: null
    colocated: {enabled: true, resources: {gpus_per_node: null}}
grpo: {max_num_steps: 7, max_rollout_turns: 1}
loss_fn: {ratio_clip_min: 0.1, token_level_loss: false, use_on_policy_kl_approximation: false}
data: {dataset_name: train.jsonl, shuffle: true}
env: {math: {num_workers: 2}}
checkpointing: {metric_name: val_reward, checkpoint_must_save_by: "00:03:50:00"}
"""
# the same run in this schema's names, written by hand from NeMo-RL's docs
PORTED = """\
policy: {model_name: m, sequence_packing: {enabled: true, algorithm: mffd}}
generation: {max_new_tokens: 24, colocated: true}
env: {name: math, num_workers: 2, max_prompt_tokens: 16, train_data: train.jsonl}
grpo: {max_steps: 7}
loss: {eps_low: 0.1, agg: seq-mean-token-mean}
checkpointing: {metric: val/reward_mean, must_save_by: "00:03:50:00"}
"""


def test_a_nemo_rl_config_gets_its_whole_port_in_one_error(tmp_path):
    """Renaming was not the whole port: the next run failed on the next key NeMo-RL has and this schema lacks (some
    thirty for grpo_math_1B.yaml). The one error now also lists the keys set otherwise here, those with no
    counterpart, and the interpolations to write out; each list is exactly what the hand-written port changed, and
    that port loads (so nothing else in the file needed a change)."""
    with pytest.raises(ConfigError, match="This config uses NeMo-RL's names") as raised:
        load_config(write(tmp_path / "nemo.yaml", NEMO_RL_PORT))
    renames, settings, removed, interpolations = str(raised.value).split("here they are spelled: ")[1].split("\n")
    assert renames.split(", ") == ["policy.generation.max_new_tokens -> generation.max_new_tokens",
                                   "policy.generation.colocated.enabled -> generation.colocated",
                                   "grpo.max_num_steps -> grpo.max_steps", "loss_fn.ratio_clip_min -> loss.eps_low",
                                   "data.dataset_name -> env.train_data",
                                   "checkpointing.checkpoint_must_save_by -> checkpointing.must_save_by"]
    assert settings.startswith("set otherwise here: ")
    assert settings.split(": ", 1)[1].split("; ") == [
        "policy.max_total_sequence_length=40 -> env.max_prompt_tokens and generation.max_new_tokens (the prompt and "
        "the completion are bounded apart here, together at most 40)",
        "policy.megatron_cfg.converter_type=Qwen2ForCausalLM -> nothing to set (ckpt-convert reads the architecture "
        "from the model's config.json)",
        "policy.sequence_packing.algorithm=modified_first_fit_decreasing -> policy.sequence_packing.algorithm=mffd",
        "policy.sequence_packing.sequence_length_round=64 -> nothing to set (a packed sequence is padded to the "
        "multiple the engine's parallelism needs, no more)", "policy.generation.top_k=null -> generation.top_k=0 (off)",
        "grpo.max_rollout_turns=1 -> nothing to set",
        "loss_fn.token_level_loss=false -> loss.agg=seq-mean-token-mean",
        "data.shuffle=true -> nothing to set (the prompts are reshuffled every epoch)", "env.math={...} -> env.name=math, "
        "env.num_workers=2", "checkpointing.metric_name=val_reward -> checkpointing.metric=val/reward_mean"]
    assert removed.startswith("no counterpart here (remove them") and set(removed.split("): ", 1)[1].split(", ")) == {
        "policy.tokenizer.name", "policy.generation.colocated.resources.gpus_per_node",
        "loss_fn.use_on_policy_kl_approximation"}  # an engine section's other keys: the engine's to check
    assert interpolations.endswith(": policy.generation.max_new_tokens=${policy.max_total_sequence_length}")
    cfg = load_config(write(tmp_path / "ours.yaml", PORTED))
    assert (cfg.grpo.max_steps, cfg.loss.eps_low, cfg.loss.agg, cfg.env.name, cfg.env.num_workers) == (
        7, 0.1, "seq-mean-token-mean", "math", 2)
    assert cfg.policy.sequence_packing.algorithm == "mffd" and cfg.checkpointing.must_save_by_s == 3 * 3600 + 50 * 60


VERL_COMMAND_LINE = [  # verl's examples/grpo_trainer/run_qwen2-7b.sh, shortened
    "algorithm.adv_estimator=grpo", "data.train_batch_size=8", "data.max_prompt_length=16",
    "data.max_response_length=24", "data.filter_overlong_prompts=True", "actor_rollout_ref.model.path=m",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.01",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.top_k=-1", "trainer.logger=[console]",
    "trainer.save_freq=-1", "trainer.test_freq=5", "trainer.total_training_steps=7", "data.truncation=error",
    "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.use_dynamic_bsz=True",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "algorithm.use_kl_in_reward=False", "trainer.critic_warmup=0", "trainer.val_before_train=False",
    "trainer.val_only=False", "trainer.max_actor_ckpt_to_keep=3"]
# the same run in this schema's names, written by hand from verl's docs (mini-batch: 4 prompts x 4 samples)
VERL_PORTED = ["env.max_prompt_tokens=16", "generation.max_new_tokens=24", "grpo.num_prompts_per_step=8",
               "policy.model_name=m", "policy.optimizer.kwargs.lr=1e-6", "policy.train_global_batch_size=16",
               "loss.kl_coef=0.01", "loss.kl_kind=k3", "grpo.num_generations_per_prompt=4", "generation.top_k=0",
               "checkpointing.enabled=false", "grpo.val_every=5", "grpo.max_steps=7", "policy.sequence_packing.enabled=true",
               "policy.sequence_packing.train_mb_tokens=2048", "policy.logprob_batch_size=4",
               "policy.dtensor_cfg.cpu_offload=false", "grpo.val_at_start=false", "checkpointing.keep_top_k=3"]


def test_a_verl_command_line_gets_its_whole_port_in_one_error():
    """verl users bring their overrides: the one error names each key's name here, the settings whose value changes
    (the mini-batch counted in prompts, the KL switch, -1 for 'off'), and the keys with no counterpart."""
    with pytest.raises(ConfigError, match="This config uses verl's names") as raised:
        load_config(None, VERL_COMMAND_LINE)
    renames, settings, removed = str(raised.value).split("here they are spelled: ")[1].split("\n")
    assert set(renames.split(", ")) == {
        "data.train_batch_size -> grpo.num_prompts_per_step", "data.max_prompt_length -> env.max_prompt_tokens",
        "data.max_response_length -> generation.max_new_tokens", "actor_rollout_ref.model.path -> policy.model_name",
        "actor_rollout_ref.actor.optim.lr -> policy.optimizer.kwargs.lr",
        "actor_rollout_ref.rollout.n -> grpo.num_generations_per_prompt",
        "trainer.total_training_steps -> grpo.max_steps",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu -> policy.logprob_batch_size",
        "trainer.val_before_train -> grpo.val_at_start"}
    assert set(settings.split(": ", 1)[1].split("; ")) == {
        "algorithm.adv_estimator=grpo -> nothing to set (the algorithm here is GRPO)",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4 -> policy.train_global_batch_size=16 (sequences here: prompts "
        "x actor_rollout_ref.rollout.n)",
        "actor_rollout_ref.actor.use_kl_loss=true -> loss.kl_coef=0.01",
        "actor_rollout_ref.actor.kl_loss_coef=0.01 -> read with actor_rollout_ref.actor.use_kl_loss (above)",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl -> loss.kl_kind=k3",
        "actor_rollout_ref.rollout.top_k=-1 -> generation.top_k=0 (0 turns top-k off here)",
        "trainer.logger=[...] -> nothing to set (metrics.jsonl is always written)",
        "trainer.save_freq=-1 -> checkpointing.enabled=false", "trainer.test_freq=5 -> grpo.val_every=5",
        "data.filter_overlong_prompts=true -> nothing to set (prompts longer than env.max_prompt_tokens are dropped, "
        "with a warning)", "actor_rollout_ref.actor.entropy_coeff=0 -> nothing to set",
        "actor_rollout_ref.model.use_remove_padding=true -> policy.sequence_packing.enabled=true",
        "actor_rollout_ref.actor.use_dynamic_bsz=true -> read with actor_rollout_ref.model.use_remove_padding (above)",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048 -> policy.sequence_packing.train_mb_tokens (or "
        "policy.dynamic_batching.train_mb_tokens)",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4 -> policy.logprob_batch_size (one for the policy's "
        "and the reference's logprobs)",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=false -> policy.dtensor_cfg.cpu_offload=false (with the "
        "parameters and gradients)",
        "algorithm.use_kl_in_reward=false -> nothing to set (the KL is a loss term here: loss.kl_coef)",
        "trainer.critic_warmup=0 -> nothing to set (GRPO has no critic)", "trainer.val_only=false -> nothing to set",
        "trainer.max_actor_ckpt_to_keep=3 -> checkpointing.keep_top_k=3 (the best 3 by checkpointing.metric, not the "
        "newest)"}
    assert set(removed.split("): ", 1)[1].split(", ")) == {"data.truncation"}
    cfg = load_config(None, VERL_PORTED)
    assert (cfg.policy.train_global_batch_size, cfg.loss.kl_coef, cfg.loss.kl_kind, cfg.generation.top_k,
            cfg.checkpointing.enabled, cfg.grpo.num_prompts_per_step) == (16, 0.01, "k3", 0, False, 8)
    assert (cfg.policy.sequence_packing.enabled, cfg.policy.sequence_packing.train_mb_tokens,
            cfg.policy.logprob_batch_size, cfg.grpo.val_at_start) == (True, 2048, 4, False)


TRL_CONFIG = """\
model_name_or_path: m
learning_rate: 1.0e-6
lr_scheduler_type: cosine
per_device_train_batch_size: 8
gradient_accumulation_steps: 2
num_generations: 4
max_completion_length: 24
beta: 0.04
epsilon: 0.2
loss_type: dr_grpo
scale_rewards: false
num_iterations: 2
bf16: false
report_to: none
max_steps: 10
"""
# the same run in this schema's names, written by hand from TRL's GRPOConfig docs
TRL_PORTED = ["policy.model_name=m", "policy.optimizer.kwargs.lr=1e-6", "policy.scheduler.decay=cosine",
              "policy.scheduler.total_steps=10", "policy.train_micro_batch_size=8", "grpo.num_prompts_per_step=4",
              "policy.train_global_batch_size=16", "grpo.num_generations_per_prompt=4", "generation.max_new_tokens=24",
              "loss.kl_coef=0.04", "loss.eps_low=0.2", "loss.eps_high=0.2", "loss.agg=seq-mean-token-sum",
              "grpo.normalize_std=false", "policy.precision=float32", "grpo.max_steps=10"]


def test_a_trl_config_gets_its_whole_port_in_one_error(tmp_path):
    """TRL's GRPOConfig fields are flat: each was an unknown top-level key. Its batch is derived (per device x
    accumulation), its epsilon is both clip bounds, and its loss_type names what loss.agg names here."""
    with pytest.raises(ConfigError, match=r"^.*trl.yaml:1: unknown config key 'model_name_or_path'; did you mean "
                                          r"'policy.model_name'\? Valid keys here: .* This config uses TRL's names") as raised:
        load_config(write(tmp_path / "trl.yaml", TRL_CONFIG))
    renames, settings, removed = str(raised.value).split("here they are spelled: ")[1].split("\n")
    assert set(renames.split(", ")) == {
        "model_name_or_path -> policy.model_name", "learning_rate -> policy.optimizer.kwargs.lr",
        "num_generations -> grpo.num_generations_per_prompt", "max_completion_length -> generation.max_new_tokens",
        "beta -> loss.kl_coef", "max_steps -> grpo.max_steps"}
    assert set(settings.split(": ", 1)[1].split("; ")) == {
        "lr_scheduler_type=cosine -> policy.scheduler.decay=cosine, policy.scheduler.total_steps=10",
        "per_device_train_batch_size=8 -> policy.train_micro_batch_size=8, and on one GPU grpo.num_prompts_per_step=4, "
        "policy.train_global_batch_size=16 (a TRL step samples and trains on 8 x 2 x <processes> completions, 4 a "
        "prompt)",
        "gradient_accumulation_steps=2 -> read with per_device_train_batch_size (above)",
        "epsilon=0.2 -> loss.eps_low=0.2, loss.eps_high=0.2", "loss_type=dr_grpo -> loss.agg=seq-mean-token-sum",
        "scale_rewards=false -> grpo.normalize_std=false", "bf16=false -> policy.precision=float32",
        "report_to=none -> nothing to set (metrics.jsonl is always written)"}
    assert removed.endswith("): num_iterations")  # TRL's PPO epochs: one pass over each batch here
    cfg = load_config(None, TRL_PORTED)
    assert (cfg.grpo.num_prompts_per_step, cfg.policy.train_global_batch_size, cfg.loss.eps_high, cfg.loss.agg) == (
        4, 16, 0.2, "seq-mean-token-sum")


# NeMo-RL's engine sections as its examples/configs/grpo_math_1B.yaml writes them (shortened)
NEMO_RL_ENGINE_SECTIONS = {
    "dtensor_cfg": {"_v2": True, "cpu_offload": False, "tensor_parallel_size": 1, "context_parallel_size": 1,
                    "custom_parallel_plan": None},
    "megatron_cfg": {"empty_unused_memory_level": 0, "converter_type": "Qwen2ForCausalLM",
                     "tensor_model_parallel_size": 1, "freeze_moe_router": False, "defer_fp32_logits": None,
                     "apply_rope_fusion": False, "fp8_cfg": None, "env_vars": None},
}
# what each engine section keeps, written by hand: the keys both engines here have by those names
NEMO_RL_ENGINE_SECTIONS_PORTED = {"dtensor_cfg": {"cpu_offload": False, "tensor_parallel_size": 1},
                                  "megatron_cfg": {"tensor_model_parallel_size": 1, "apply_rope_fusion": False}}


@pytest.mark.parametrize("engine", ["dtensor", "megatron"])
def test_nemo_rl_engine_sections_get_their_port_with_the_engines_error(engine):
    """The port of a NeMo-RL config left its engine sections to the engines, whose errors named NeMo-RL's own keys
    as unknown (suggesting 'tensor_parallel_size' for `context_parallel_size`): each is said what it is here, and
    once the port's keys are gone the sections validate."""
    def overrides(sections: dict) -> list[str]:
        switch = {"dtensor_cfg": engine == "dtensor", "megatron_cfg": engine == "megatron"}
        return [f"policy.{name}={yaml.safe_dump({**keys, 'enabled': switch[name]}, default_flow_style=True).strip()}"
                for name, keys in sections.items()]

    with pytest.raises(ConfigError) as raised:
        preflight(load_config(None, overrides(NEMO_RL_ENGINE_SECTIONS)))
    message = str(raised.value)
    assert f"unknown config key{'s' * (engine == 'megatron')} 'policy.{engine}_cfg." in message
    said = {item.split("=", 1)[0] for item in
            message.split("The engine sections use NeMo-RL's names; set otherwise here: ")[1].split("; ")}
    assert said == {f"policy.{section}.{key}" for section, keys in NEMO_RL_ENGINE_SECTIONS.items() for key in keys
                    if key not in NEMO_RL_ENGINE_SECTIONS_PORTED[section]}
    assert "policy.megatron_cfg.converter_type=Qwen2ForCausalLM -> nothing to set (ckpt-convert reads" in message
    preflight(load_config(None, overrides(NEMO_RL_ENGINE_SECTIONS_PORTED)))
