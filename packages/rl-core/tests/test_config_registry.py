"""Config validation errors, the engine registry, and the metric reduction rule."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

import pytest
import torch

from rl_core.config import (
    ConfigError,
    LossConfig,
    OptimizerConfig,
    PolicyConfig,
    UnknownKeyError,
    parse_config,
    schema_keys,
    unknown_keys,
    with_keys_elsewhere,
)
from rl_core.metrics import all_reduce_metrics, combine_metrics, combine_optimizer_steps
from rl_core.registry import ENGINES, Registry, create_engine, register_engine
from rl_core.testing.distributed import CUDA_BACKEND, run_distributed


@dataclass(kw_only=True)
class Inner:
    lr: float = 1e-3
    name: str = "adam"


@dataclass(kw_only=True)
class Outer:
    steps: int
    inner: Inner = field(default_factory=Inner)
    tags: list[str] = field(default_factory=list)


def test_parse_nested_and_coerce_int_to_float():
    cfg = parse_config(Outer, {"steps": 3, "inner": {"lr": 1}, "tags": ["a"]})
    assert cfg.steps == 3 and cfg.inner.lr == 1.0 and isinstance(cfg.inner.lr, float) and cfg.tags == ["a"]


def test_unknown_key_names_closest_with_full_path():
    with pytest.raises(ConfigError, match=r"unknown config key 'loss\.inner\.lrr'.*did you mean 'loss\.inner\.lr'"):
        parse_config(Outer, {"steps": 1, "inner": {"lrr": 1.0}}, "loss")


def test_schema_keys_reach_nested_sections_and_the_keys_of_default_mappings():
    keys = schema_keys(PolicyConfig)
    assert {"model_name", "optimizer.name", "optimizer.kwargs.lr", "sequence_packing.train_mb_tokens",
            "megatron_cfg.enabled"} <= set(keys)
    assert "optimizer" in keys and "kwargs" not in keys  # sections and their own dotted keys, nothing top-level twice


def test_every_unknown_key_of_a_level_is_named_in_one_error():
    with pytest.raises(UnknownKeyError) as raised:
        parse_config(Outer, {"stpes": 2, "steps": 1, "tgas": [], "colour": "red", "inner": {"lrr": 1}}, "x")
    assert (raised.value.dotted, raised.value.others) == ("x.stpes", ["tgas", "colour"])  # inner's come next
    assert str(raised.value).startswith("unknown config key 'x.stpes'; did you mean 'x.steps'? Also unknown here: "
                                        "'x.tgas' (did you mean 'x.tags'?), 'x.colour'. Valid keys here: ")


def test_unknown_keys_lists_every_one_parse_config_would_stop_at():
    """Each key listed is one parse_config refuses, and without them the data parses: the list is the whole of it."""
    data = {"model_name": "m", "lr": 1e-3, "optimizer": {"nme": "AdamW", "kwargs": {"lr": 1e-3, "betas": [0.9, 0.99]}},
            "scheduler": {"warmup_steps": 1, "style": "cosine"}, "dtensor_cfg": {"anything": 1},
            "tokenizer": {"name": "m", "fast": {"enabled": True}}}
    found = unknown_keys(PolicyConfig, data, "policy")
    assert found == ["policy.lr", "policy.tokenizer.name", "policy.tokenizer.fast.enabled", "policy.optimizer.nme",
                     "policy.scheduler.style"]  # a section's own first; a mapping field (kwargs, dtensor_cfg) takes any key
    for key in found:  # parse_config refuses it (or the unknown section it is in)
        section = key.split(".")[1]
        with pytest.raises(UnknownKeyError) as raised:
            parse_config(PolicyConfig, {"model_name": "m", section: data[section]}, "policy")
        assert key == raised.value.dotted or key.startswith(raised.value.dotted + ".")
    del data["lr"], data["optimizer"]["nme"], data["scheduler"]["style"], data["tokenizer"]
    assert parse_config(PolicyConfig, data, "policy").scheduler.warmup_steps == 1


def test_an_unknown_key_without_a_neighbour_of_its_level_suggests_the_key_of_its_name_elsewhere():
    """`policy.lr` (the learning rate one level up) had no suggestion: the closest keys of `policy` are nothing
    like `lr`; the key of that name is `policy.optimizer.kwargs.lr`."""
    with pytest.raises(ConfigError) as raised:
        parse_config(PolicyConfig, {"model_name": "m", "lr": 1e-3}, "policy")
    assert "did you mean" not in str(raised.value)
    hinted = with_keys_elsewhere(raised.value, PolicyConfig)
    assert "unknown config key 'policy.lr'; did you mean 'optimizer.kwargs.lr'?" in str(hinted)
    with pytest.raises(ConfigError) as raised:  # one of its level stays the suggestion
        parse_config(PolicyConfig, {"model_name": "m", "model_nam": "x"}, "policy")
    assert "did you mean 'policy.model_name'?" in str(with_keys_elsewhere(raised.value, PolicyConfig))


def test_an_engine_switch_that_is_not_a_bool_is_refused():
    """`megatron_cfg.enabled=maybe` (any string: 'False' quoted in YAML too) was truthy and chose Megatron."""
    for value in ("maybe", "False", 1):
        with pytest.raises(ConfigError, match=rf"'policy.megatron_cfg.enabled' must be a bool \(true or false\); "
                                              rf"got {type(value).__name__} {value!r}"):
            PolicyConfig(model_name="m", megatron_cfg={"enabled": value})
    with pytest.raises(ConfigError, match=r"'policy.dtensor_cfg.enabled' must be a bool"):
        PolicyConfig(model_name="m", dtensor_cfg={"enabled": "no"})


def test_optimizer_name_in_nemo_rls_spelling_is_the_class_name():
    assert OptimizerConfig(name="torch.optim.AdamW").name == "AdamW"
    assert OptimizerConfig(name="SGD", kwargs={"lr": 0.1}).name == "SGD"


def test_an_omegaconf_interpolation_is_named_as_one():
    with pytest.raises(ConfigError, match=r"'steps' must be an integer; got str '\$\{grpo.max_steps\}' \(\$\{...\} "
                                          r"is an OmegaConf interpolation, which this config does not evaluate"):
        parse_config(Outer, {"steps": "${grpo.max_steps}"})


def test_wrong_type_and_missing_required_are_named():
    with pytest.raises(ConfigError, match=r"'steps' must be an integer; got str"):
        parse_config(Outer, {"steps": "ten"})
    with pytest.raises(ConfigError, match=r"'steps' is required"):
        parse_config(Outer, {})
    with pytest.raises(ConfigError, match=r"'loss.agg' = 'mean' is not allowed"):
        parse_config(LossConfig, {"agg": "mean"}, "loss")


def test_wrong_type_from_a_yaml_reading_names_the_reading():
    """PyYAML (YAML 1.1) reads `lr: 1e-3` as a string and `name: a: b` as a mapping: the error says so."""
    with pytest.raises(ConfigError, match=r"'inner.lr' must be a number; got str '1e-3' \(YAML 1.1 reads 1e-3 as a "
                                          r"string; write 1.0e-03\)$"):
        parse_config(Outer, {"steps": 1, "inner": {"lr": "1e-3"}})
    with pytest.raises(ConfigError, match=r"'inner.name' must be a str; got dict \{'a': 'b'\} \(YAML reads an "
                                          r"unquoted 'a: b' as a mapping"):
        parse_config(Outer, {"steps": 1, "inner": {"name": {"a": "b"}}})
    with pytest.raises(ConfigError, match=r"'inner.lr' must be a number; got str 'fast'$"):
        parse_config(Outer, {"steps": 1, "inner": {"lr": "fast"}})


def test_policy_engine_selection_and_conflicts():
    assert PolicyConfig(model_name="m").engine_name == "dtensor"
    on = PolicyConfig(model_name="m", megatron_cfg={"enabled": True, "tensor_model_parallel_size": 2})
    assert on.engine_name == "megatron" and on.engine_options == {"tensor_model_parallel_size": 2}
    with pytest.raises(ConfigError, match="not both"):
        PolicyConfig(model_name="m", megatron_cfg={"enabled": True}, dtensor_cfg={"enabled": True})
    with pytest.raises(ConfigError, match="No training engine"):
        PolicyConfig(model_name="m", dtensor_cfg={"enabled": False})
    with pytest.raises(ConfigError, match="policy.optimizer.kwargs.lr"):
        parse_config(PolicyConfig, {"model_name": "m", "optimizer": {"kwargs": {}}}, "policy")


def test_policy_engine_key_selects_any_name_and_names_conflicts():
    third = PolicyConfig(model_name="m", engine="titan", engine_cfg={"compile": True})
    assert third.engine_name == "titan" and third.engine_options == {"compile": True}
    assert third.engine_config_key == "policy.engine"
    # the built-in engines take either section; the seeds' switch agreeing with policy.engine is fine
    assert PolicyConfig(model_name="m", engine="megatron", megatron_cfg={"enabled": True, "seed": 3}
                        ).engine_options == {"seed": 3}
    assert PolicyConfig(model_name="m", engine="megatron", engine_cfg={"seed": 4}).engine_options == {"seed": 4}
    with pytest.raises(ConfigError, match=r"policy.engine='titan' conflicts with policy.megatron_cfg.enabled"):
        PolicyConfig(model_name="m", engine="titan", megatron_cfg={"enabled": True})
    with pytest.raises(ConfigError, match=r"policy.engine_cfg and policy.megatron_cfg both configure"):
        PolicyConfig(model_name="m", engine="megatron", engine_cfg={"seed": 1}, megatron_cfg={"seed": 2})
    with pytest.raises(ConfigError, match=r"policy.engine_cfg is the section of an engine chosen by policy.engine"):
        PolicyConfig(model_name="m", engine_cfg={"seed": 1})


@pytest.mark.parametrize("kwargs,unused", [
    ({"megatron_cfg": {"enabled": True}, "dtensor_cfg": {"tensor_parallel_size": 2}}, "policy.dtensor_cfg"),
    ({"megatron_cfg": {"enabled": False, "tensor_model_parallel_size": 2}}, "policy.megatron_cfg"),
    ({"engine": "titan", "dtensor_cfg": {"compile": True}}, "policy.dtensor_cfg"),
    ({"megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 2}}, None),
    ({"dtensor_cfg": {"tensor_parallel_size": 2}, "megatron_cfg": {"enabled": False}}, None),
])
def test_options_of_the_engine_not_running_are_a_warning(kwargs, unused, caplog, monkeypatch):
    """Once: the trainer rebuilds the config (dataclasses.replace resolves the model path), the log says it once."""
    import dataclasses

    import rl_core.config

    monkeypatch.setattr(rl_core.config, "_WARNED", set())
    with caplog.at_level("WARNING", logger="rl_core.config"):
        policy = PolicyConfig(model_name="m", **kwargs)
        dataclasses.replace(policy, model_name="/resolved/m")
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert [w.split(" ")[0] for w in warnings] == ([unused] if unused else [])
    options = [key for key in kwargs[unused.removeprefix("policy.")] if key != "enabled"] if unused else []
    assert not unused or f"{unused} ({', '.join(options)}) is unused" in warnings[0]  # the keys, not their values


@pytest.mark.parametrize("kwargs,section,runs,goes", [
    ({"megatron_cfg": {"enabled": True}, "dtensor_cfg": {"lora_cfg": {"enabled": True}}}, "policy.dtensor_cfg",
     "'megatron' engine runs (policy.megatron_cfg.enabled)", "policy.megatron_cfg.lora_cfg"),
    ({"megatron_cfg": {"enabled": False, "lora_cfg": {"enabled": True}}}, "policy.megatron_cfg",
     "'dtensor' engine runs (policy.dtensor_cfg.enabled)", "policy.dtensor_cfg.lora_cfg"),
    ({"engine": "titan", "dtensor_cfg": {"lora_cfg": {"enabled": True, "dim": 4}}}, "policy.dtensor_cfg",
     "'titan' engine runs (policy.engine)", "policy.engine_cfg.lora_cfg"),
])
def test_lora_in_the_section_of_an_engine_not_running_is_an_error(kwargs, section, runs, goes):
    """Not the unused-options warning: the engine that runs would train every weight, not adapters."""
    with pytest.raises(ConfigError) as error:
        PolicyConfig(model_name="m", **kwargs)
    assert str(error.value).startswith(f"{section}.lora_cfg.enabled=true, but the {runs} and would train every "
                                       f"weight: LoRA goes under {goes} (the same keys)"), str(error.value)
    PolicyConfig(model_name="m", **{**kwargs, section.split(".")[1]: {"lora_cfg": {"enabled": False}}})


@pytest.mark.parametrize("kwargs,key", [
    ({}, "policy.dtensor_cfg"),
    ({"megatron_cfg": {"enabled": True}}, "policy.megatron_cfg"),
    ({"engine": "megatron", "megatron_cfg": {"seed": 3}}, "policy.megatron_cfg"),
    ({"engine": "megatron", "engine_cfg": {"seed": 4}}, "policy.engine_cfg"),
    ({"engine": "dtensor", "engine_cfg": {"compile": True}}, "policy.engine_cfg"),
    ({"engine": "titan"}, "policy.engine_cfg"),
])
def test_engine_options_key_names_the_section_the_options_came_from(kwargs, key):
    assert PolicyConfig(model_name="m", **kwargs).engine_options_key == key


def test_registry_entry_points_and_unknown_names():
    assert {"dtensor", "megatron"} <= set(ENGINES.names())

    @register_engine("toy-registered")
    class Toy:
        def __init__(self, policy, **kwargs):
            self.policy, self.kwargs = policy, kwargs

    policy = PolicyConfig(model_name="m")
    ENGINES._classes["dtensor"] = Toy  # stand in for the installed class: this test checks routing only
    try:
        engine = create_engine(policy, extra=1)
        assert isinstance(engine, Toy) and engine.kwargs == {"extra": 1}
    finally:
        del ENGINES._classes["dtensor"]
    with pytest.raises(ValueError, match=r"policy.engine: training engine 'nope' is not registered; choose one "
                       r"of \[.*'dtensor'"):
        create_engine(PolicyConfig(model_name="m", engine="nope"))
    missing = Registry("training engine", "rl_core.engines.none-installed", {"titan": "torchtitan-engine"})
    with pytest.raises(ValueError, match=r"policy.engine selects training engine 'titan', which is not "
                       r"installed: pip install torchtitan-engine"):
        missing.get("titan", config_key="policy.engine")


def test_one_class_per_name(monkeypatch):
    """Two packages (or a package and an in-process class) claiming one name is an error naming both,
    whatever the import order; a broken entry point names its value; an unknown name lists the wheels."""
    import importlib.metadata as md

    import rl_core.registry as registry

    group = "rl_core.test-engines"
    points = [md.EntryPoint("twin", "pkg_a.engine:Engine", group), md.EntryPoint("twin", "pkg_b.engine:Engine", group),
              md.EntryPoint("broken", "rl_core.config:NoSuchEngine", group)]
    monkeypatch.setattr(registry, "entry_points", lambda group: [p for p in points if p.group == group])
    engines = Registry("training engine", group, {"titan": "torchtitan-engine"})
    with pytest.raises(ValueError, match=r"'twin' is provided by two installed packages .*pkg_a.engine:Engine.*"
                                         r"pkg_b.engine:Engine.*uninstall one"):
        engines.get("twin", config_key="policy.engine")
    del points[1]
    with pytest.raises(ValueError, match=r"'twin' is taken by pkg_a.engine:Engine; register .*Other under another"):
        engines.register("twin")(type("Other", (), {}))
    with pytest.raises(ValueError, match=r"'broken' is installed but failed to import.*NoSuchEngine"):
        engines.get("broken", config_key="policy.engine")
    with pytest.raises(ValueError, match=r"'nope' is not registered; choose one of \['broken', 'twin'\] \(or "
                                         r"install torchtitan-engine\)"):
        engines.get("nope", config_key="policy.engine")
    first = engines.register("mine")(type("Mine", (), {}))
    assert engines.register("mine")(first) is first  # the same class again (a re-import) is fine


def test_combine_metrics_sums_and_extremes():
    parts = [{"loss": 1.0, "ratio_min": 0.9, "ratio_max": 1.1}, {"loss": torch.tensor(2.0), "ratio_min": 0.8,
                                                                  "ratio_max": 1.05}]
    assert combine_metrics(parts) == {"loss": 3.0, "ratio_min": 0.8, "ratio_max": 1.1}


def test_combine_metrics_reads_tensors_back_once_not_per_value():
    """A loss's metrics are device tensors: reading each with float() waits for the GPU once per value and
    micro-batch. Reduced on their device and read back together, no per-value read (`item`) is left."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class ItemReads(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func is torch.ops.aten._local_scalar_dense.default
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    parts = [{"kl": torch.rand((), generator=gen), "ratio_min": torch.rand((), generator=gen),
              "ratio_max": torch.rand((), generator=gen), "tokens": float(i)} for i in range(6)]
    with ItemReads() as reads:
        got = combine_metrics(parts)
    assert reads.count == 0
    assert got == pytest.approx({"kl": sum(float(p["kl"]) for p in parts), "tokens": 15.0,
                                 "ratio_min": min(float(p["ratio_min"]) for p in parts),
                                 "ratio_max": max(float(p["ratio_max"]) for p in parts)}, rel=1e-12)
    assert list(got) == ["kl", "ratio_min", "ratio_max", "tokens"]


def test_optimizer_steps_average_means_add_counts_and_keep_extremes():
    """A GRPO step of two optimizer steps: one with 3 non-finite tokens (skipped), one clean. The skipped
    step's grad norm is left out of the mean even where finite (megatron's found_inf): it was not applied."""
    steps = [{"loss": 1.0, "grad_norm": 2.0, "ratio_min": 0.5, "ratio_max": 5.0, "nonfinite_logprob_tokens": 3.0,
              "skipped": 1.0, "num_micro_batches": 4.0, "gpu_allocated_gib_max": 7.0},
             {"loss": 3.0, "grad_norm": 4.0, "ratio_min": 0.9, "ratio_max": 1.1, "nonfinite_logprob_tokens": 0.0,
              "skipped": 0.0, "num_micro_batches": 4.0, "gpu_allocated_gib_max": 6.5}]
    assert combine_optimizer_steps(steps) == {
        "loss": 2.0, "grad_norm": 4.0, "ratio_min": 0.5, "ratio_max": 5.0, "nonfinite_logprob_tokens": 3.0,
        "skipped": 1.0, "num_micro_batches": 8.0, "gpu_allocated_gib_max": 7.0}
    assert combine_optimizer_steps(steps[1:]) == steps[1]


@pytest.mark.parametrize("bad_norm", [math.nan, math.inf])
def test_skipped_optimizer_step_does_not_make_the_grad_norm_nan(bad_norm):
    """As the engines report a skipped step (non-finite grad norm, `skipped` 1): the GRPO step's grad norm
    is the mean over the applied steps, NaN only when all were skipped; the skip count is still summed."""
    def step(grad_norm, skipped):
        return {"loss": 1.0, "grad_norm": grad_norm, "lr": 1e-6, "skipped": skipped, "num_micro_batches": 2.0}

    steps = [step(2.0, 0.0), step(bad_norm, 1.0), step(4.0, 0.0)]
    got = combine_optimizer_steps(steps)
    assert got == {"loss": 1.0, "grad_norm": 3.0, "lr": 1e-6, "skipped": 1.0, "num_micro_batches": 6.0}
    # without a `skipped` key a non-finite grad norm alone marks the step as not applied
    assert combine_optimizer_steps([{"grad_norm": bad_norm}, {"grad_norm": 5.0}]) == {"grad_norm": 5.0}
    all_skipped = combine_optimizer_steps([step(bad_norm, 1.0), step(math.nan, 1.0)])
    assert math.isnan(all_skipped["grad_norm"]) and all_skipped["skipped"] == 2.0


def test_optimizer_step_without_loss_tokens_is_left_out_of_the_means():
    """Two optimizer steps, the second without a loss token (its mini-batch overlong-filtered away): its NaN
    per-token means and its 0 loss and grad norm describe no data, so the GRPO step logs the first step's; counts
    still add up, and only a GRPO step with no loss token at all logs NaN."""
    with_tokens = {"loss": -0.27, "ratio_mean": 0.95, "grad_norm": 0.58, "lr": 1e-6, "skipped": 0.0, "loss_tokens": 3.0,
                   "num_micro_batches": 1.0, "ratio_min": 0.9}
    empty = {"loss": 0.0, "ratio_mean": math.nan, "grad_norm": 0.0, "lr": 1e-6, "skipped": 0.0, "loss_tokens": 0.0,
             "num_micro_batches": 1.0, "ratio_min": math.inf}
    got = combine_optimizer_steps([with_tokens, empty])
    assert got == {**with_tokens, "num_micro_batches": 2.0}
    assert combine_optimizer_steps([empty, with_tokens]) == got
    nothing = combine_optimizer_steps([empty, empty])
    assert math.isnan(nothing["ratio_mean"]) and nothing["loss"] == 0.0 and nothing["loss_tokens"] == 0.0


def _reduce_on_rank(rank, world_size):
    return all_reduce_metrics({"loss": float(rank + 1), "ratio_min": 1.0 - rank, "ratio_max": float(rank)})


@pytest.mark.distributed
def test_all_reduce_metrics_over_two_ranks():
    results = run_distributed(_reduce_on_rank, world_size=2)
    assert results[0] == results[1] == {"loss": 3.0, "ratio_min": 0.0, "ratio_max": 1.0}


_SET_IN_PARENT_ONLY: list[int] = []  # a forked rank would inherit the parent's append; a spawned one not


def _rank_and_cuda_state(rank, world_size):
    return all_reduce_metrics({"loss": float(rank + 1)}), len(_SET_IN_PARENT_ONLY), os.getpid()


@pytest.mark.distributed
def test_run_distributed_spawn_mode_runs_gloo_ranks_in_fresh_interpreters():
    """The start method CUDA tests use: spawned ranks load the test function from this file by path."""
    _SET_IN_PARENT_ONLY.append(1)
    results = run_distributed(_rank_and_cuda_state, world_size=2, start_method="spawn")
    _SET_IN_PARENT_ONLY.clear()
    assert [r[0] for r in results] == [{"loss": 3.0}, {"loss": 3.0}]
    assert [r[1] for r in results] == [0, 0]
    assert len({r[2] for r in results} | {os.getpid()}) == 3


def _rendezvous_port(rank, world_size):
    return int(os.environ["MASTER_PORT"]), all_reduce_metrics({"loss": float(rank + 1)})


@pytest.mark.distributed
def test_run_distributed_rendezvous_survives_a_port_taken_after_it_was_picked(monkeypatch):
    """CI saw "EADDRINUSE ... port: 35259": a port the harness found free in the parent (rl_core.distributed's
    free_port, since removed) was taken before rank 0 listened on it. Here any port so found is one a socket of
    this test already listens on: the ranks must still meet."""
    import socket

    import rl_core.distributed
    import rl_core.testing.distributed as harness

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        monkeypatch.setattr(rl_core.distributed, "free_port", lambda host="127.0.0.1": busy, raising=False)
        monkeypatch.setattr(harness, "free_port", lambda host="127.0.0.1": busy, raising=False)
        results = run_distributed(_rendezvous_port, world_size=2, timeout=60)
    ports = {port for port, _ in results}
    assert len(ports) == 1 and busy not in ports  # one store, on a port the OS gave rank 0
    assert [metrics for _, metrics in results] == [{"loss": 3.0}, {"loss": 3.0}]


def test_run_distributed_refuses_to_fork_nccl_ranks():
    with pytest.raises(ValueError, match="forked ranks cannot use CUDA"):
        run_distributed(_rank_and_cuda_state, world_size=2, backend=CUDA_BACKEND, start_method="fork")


def _hanging_rank(rank, world_size):
    if rank == 1:
        time.sleep(60)  # never reports within the test's timeout
    return rank


def _dying_rank(rank, world_size):
    os._exit(3)


@pytest.mark.distributed
def test_run_distributed_names_a_hung_rank_with_its_stack_and_a_dead_one_with_its_code(capfd):
    with pytest.raises(RuntimeError, match=r"rank 1 still running \(its stack is in the test's stderr\)$"):
        run_distributed(_hanging_rank, world_size=2, timeout=8)
    assert "in _hanging_rank" in capfd.readouterr().err  # the stack of the rank that hung, where it hung
    with pytest.raises(RuntimeError, match="rank 0 exited with code 3 without reporting"):
        run_distributed(_dying_rank, world_size=1, timeout=3)


class _Finalised:
    """Cyclic garbage whose finaliser records the process that runs it."""

    def __init__(self, record: str) -> None:
        self.record, self.cycle = record, self

    def __del__(self) -> None:
        with open(self.record, "a") as out:
            out.write(f"{os.getpid()}\n")


def _collect(rank, world_size):
    import gc

    gc.collect()


@pytest.mark.distributed
def test_garbage_of_the_parent_is_finalised_in_the_parent_not_in_a_forked_rank(tmp_path):
    """A forked rank that collected the parent's garbage ran destructors that join threads fork did not copy: a
    Ray GcsClient left by a test that ran Ray in the pytest process hung the next forked rank for good."""
    record = tmp_path / "finalised"
    _Finalised(str(record))  # garbage now, collected by the next gc.collect()
    run_distributed(_collect, world_size=1)
    assert record.read_text().split() == [str(os.getpid())]


@pytest.mark.parametrize(("scheduler", "message"), [
    ({"min_lr_ratio": -1.0}, r"min_lr_ratio must be in \[0, 1\] \(a fraction of the lr\); got -1.0"),
    ({"min_lr_ratio": 1.5}, r"min_lr_ratio must be in \[0, 1\]"),
    ({"total_steps": 0}, r"total_steps >= 1"),
    ({"warmup_steps": -2}, r"warmup_steps must be >= 0"),
])
def test_scheduler_values_that_would_train_backwards_or_divide_by_zero_are_refused(scheduler, message):
    """min_lr_ratio=-1 with linear decay ran at lr -0.001 (exit 0, no warning): the model trained away from the
    reward."""
    with pytest.raises(ConfigError, match=message):
        parse_config(PolicyConfig, {"model_name": "m", "scheduler": scheduler}, "policy")


def test_a_temperature_whose_logits_overflow_is_refused():
    """policy.temperature=1e-39 passed (> 0); logits / T overflowed float32 in the sampler and the engines."""
    with pytest.raises(ConfigError, match=r"policy.temperature must be >= 1e-05 \(below it logits / temperature "
                                          r"overflow float32\); got 1e-39"):
        PolicyConfig(model_name="m", temperature=1e-39)
    assert PolicyConfig(model_name="m", temperature=1e-5).temperature == 1e-5
