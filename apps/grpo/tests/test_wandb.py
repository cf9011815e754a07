"""Weights & Biases logging (logger.wandb): offline runs only, read back with wandb's own reader of its run
files (`wandb leet inspect --json`), so nothing here reaches W&B's servers."""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import ray

pytest.importorskip("wandb")

import wandb  # noqa: E402

from grpo_app.config import WandbConfig, load_config  # noqa: E402
from grpo_app.main import main  # noqa: E402
from grpo_app.metrics_sink import WANDB_RUN_ID_FILE, MetricsSink, read_jsonl  # noqa: E402
from grpo_app.preflight import check_wandb_installed  # noqa: E402
from rl_core.config import ConfigError  # noqa: E402

OFFLINE = WandbConfig(enabled=True, mode="offline", tags=["test"])
RUN_CONFIG = {"grpo": {"max_steps": 5}, "logger": {"log_dir": "x"}}
WANDB_KEYS = ("_step", "_runtime", "_timestamp")


@pytest.fixture(autouse=True)
def offline_wandb(tmp_path_factory, monkeypatch):
    """W&B offline and quiet, its files in a temp dir; an unreachable server in case anything tried to upload."""
    home = tmp_path_factory.mktemp("wandb_home")
    for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(home))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")


def wandb_records(run_dir: Path) -> list[dict]:
    """The records of one offline run, as wandb's reader prints them (one JSON object a line)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)],
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def offline_runs(log_dir: Path) -> list[Path]:
    return sorted((log_dir / "wandb").glob("offline-run-*"))


def history(records: list[dict]) -> list[dict]:
    """History rows as metrics.jsonl writes records: `step` first, W&B's own keys dropped."""
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    return [{"step": row["_step"], **{k: v for k, v in row.items() if k not in WANDB_KEYS}} for row in rows]


def run_record(records: list[dict]) -> dict:
    return next(r["run"] for r in records if r["type"] == "run")


def log_steps(sink: MetricsSink, steps: range, offset: float = 0.0) -> None:
    for step in steps:
        val = {"val/reward_mean": 0.25 * step} if step % 2 == 0 else {}
        sink.log(step, {**val, "train/loss": offset + step, "train/grad_norm": float("nan") if step == 1 else 1.0,
                        "timing/train_s": 0.5, "timing/step_s": 0.5})


def test_an_offline_run_holds_every_record_of_metrics_jsonl_and_the_config(tmp_path):
    sink = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    sink.start_wandb(OFFLINE, RUN_CONFIG)
    log_steps(sink, range(4))
    sink.close()
    (run_dir,) = offline_runs(tmp_path)
    records = wandb_records(run_dir)
    assert history(records) == read_jsonl(tmp_path / "metrics.jsonl")  # NaN as null in both
    run = run_record(records)
    assert run["run_id"] == (tmp_path / WANDB_RUN_ID_FILE).read_text()
    assert (run["project"], run["display_name"], run["tags"]) == ("grpo", tmp_path.name, ["test"])
    assert {k: v for k, v in run["config"]["update"].items() if k != "_wandb"} == RUN_CONFIG
    assert next(r["exit"]["exit_code"] for r in records if r["type"] == "exit") == 0


def test_a_resumed_run_rewinds_its_wandb_run_to_the_step_before_it(tmp_path):
    first = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    first.start_wandb(OFFLINE, RUN_CONFIG)
    log_steps(first, range(5))
    first.close(failed=True)
    run_id = (tmp_path / WANDB_RUN_ID_FILE).read_text()
    resumed = MetricsSink(tmp_path, tensorboard=False, resume_step=3)  # steps 3 and 4 run again
    resumed.start_wandb(OFFLINE, RUN_CONFIG)
    log_steps(resumed, range(3, 6), offset=100.0)
    resumed.close()
    before, after = (wandb_records(d) for d in offline_runs(tmp_path))
    assert next(r["exit"]["exit_code"] for r in before if r["type"] == "exit") == 1
    run = run_record(after)
    assert run["run_id"] == run_id and run["branch_point"] == {"metric": "_step", "run": run_id, "value": 2}
    assert [r["step"] for r in history(before)] == [0, 1, 2, 3, 4]
    assert history(after) == read_jsonl(tmp_path / "metrics.jsonl")[3:]  # the new steps 3, 4 and 5


def test_a_refused_rewind_continues_the_run_and_names_the_steps_wandb_keeps(tmp_path, monkeypatch, caplog):
    first = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    first.start_wandb(OFFLINE, RUN_CONFIG)
    log_steps(first, range(5))
    first.close()
    init = wandb.init

    def refuse_rewind(**kwargs):  # as a W&B server without the rewind preview answers
        if "resume_from" in kwargs:
            raise wandb.errors.CommError("rewind is not enabled for this entity")
        return init(**kwargs)

    monkeypatch.setattr(wandb, "init", refuse_rewind)
    resumed = MetricsSink(tmp_path, tensorboard=False, resume_step=3)
    with caplog.at_level(logging.WARNING, logger="grpo_app.metrics_sink"):
        resumed.start_wandb(OFFLINE, RUN_CONFIG)
    resumed.close()
    assert "steps 3..4 are not logged to W&B again" in caplog.text and "metrics.jsonl and TensorBoard" in caplog.text
    run = run_record(wandb_records(offline_runs(tmp_path)[-1]))
    assert run["run_id"] == (tmp_path / WANDB_RUN_ID_FILE).read_text() and run["resume"] is True


def test_wandb_not_logged_in_is_a_config_error_naming_the_ways_out(tmp_path, monkeypatch):
    def not_logged_in(**kwargs):  # what wandb.init raises online without an API key
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", not_logged_in)
    sink = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    with pytest.raises(ConfigError, match=r"logger.wandb: .*wandb login.*WANDB_API_KEY.*logger.wandb.mode=offline"):
        sink.start_wandb(WandbConfig(enabled=True, mode="online"), RUN_CONFIG)


@pytest.mark.parametrize("resume_step", [None, 3], ids=["new-run", "resume-with-rewind"])
def test_wandb_server_unreachable_is_one_config_error_naming_offline_mode(tmp_path, monkeypatch, resume_step):
    if resume_step is not None:  # a W&B run with steps 0..4: the resume asks for a rewind first
        first = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
        first.start_wandb(OFFLINE, RUN_CONFIG)
        log_steps(first, range(5))
        first.close()
    calls = []

    def no_network(**kwargs):  # what wandb.init raises online with a key but no route, after init_timeout
        calls.append(kwargs)
        raise wandb.errors.CommError('Timed out while retrying: Post "https://api.wandb.ai/graphql": no such host\n'
                                     "Consider increasing the init_timeout setting:")

    monkeypatch.setattr(wandb, "init", no_network)
    sink = MetricsSink(tmp_path, tensorboard=False, resume_step=resume_step)
    with pytest.raises(ConfigError, match=r"could not reach its server: Timed out.*no such host; .*mode=offline") as err:
        sink.start_wandb(WandbConfig(enabled=True, mode="online"), RUN_CONFIG)
    assert "\n" not in str(err.value)
    assert len(calls) == 1  # each init waits init_timeout (90 s): a resume once, not again without the rewind


def test_wandb_turned_on_at_a_resume_gets_the_earlier_steps_too(tmp_path):
    first = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    log_steps(first, range(4))
    first.close()
    resumed = MetricsSink(tmp_path, tensorboard=False, resume_step=2)
    resumed.start_wandb(OFFLINE, RUN_CONFIG)
    log_steps(resumed, range(2, 4), offset=100.0)
    resumed.close()
    (run_dir,) = offline_runs(tmp_path)
    assert history(wandb_records(run_dir)) == read_jsonl(tmp_path / "metrics.jsonl")


def test_the_summary_plot_goes_to_the_wandb_run(tmp_path):
    sink = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    sink.start_wandb(OFFLINE, RUN_CONFIG)
    log_steps(sink, range(2))
    sink.plot(tmp_path / "summary.png")
    sink.close()
    (run_dir,) = offline_runs(tmp_path)
    rows = [r["history"]["item"] for r in wandb_records(run_dir) if r["type"] == "history"]
    assert rows[-1]["_step"] == 1 and rows[-1]["summary/plot._type"] == "image-file"
    assert list((run_dir / "files/media/images").glob("summary/plot_1_*.png"))


def test_disabled_wandb_starts_nothing(tmp_path):
    sink = MetricsSink(tmp_path, tensorboard=False, resume_step=None)
    sink.start_wandb(WandbConfig(), RUN_CONFIG)
    sink.log(0, {"train/loss": 1.0})
    sink.close()
    assert sink.wandb_run is None and not (tmp_path / "wandb").exists()


def test_wandb_missing_stops_the_run_at_preflight_naming_the_install(monkeypatch, caplog):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    check_wandb_installed(WandbConfig())  # off: not needed
    with pytest.raises(ConfigError, match=r"logger.wandb.enabled=true needs the wandb package.*uv sync --extra wandb"):
        check_wandb_installed(WandbConfig(enabled=True))
    with caplog.at_level(logging.ERROR, logger="grpo"):
        assert main(["logger.tensorboard=false", "logger.wandb.enabled=true"]) == 2
    assert "uv sync --extra wandb" in caplog.text and not ray.is_initialized()


@pytest.mark.parametrize("override, message", [
    ("logger.wandb.projet=x", r"'logger.wandb.projet'; did you mean 'logger.wandb.project'"),
    ("logger.wandb.mode=offlne", r"'logger.wandb.mode' = 'offlne'.*choose one of \['online', 'offline', 'disabled'\]"),
    ("logger.wandb.tags=rl", r"'logger.wandb.tags' must be a list"),
])
def test_a_bad_wandb_key_or_value_names_it(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])
