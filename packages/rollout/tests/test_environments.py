"""Reward environments: math-verify equivalences, boxed extraction, toy rewards, and the worker pool's
handling of crashes, timeouts and bad return values (counted, scored 0, run goes on)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from rl_core.interfaces import Environment, RewardRequest
from rollout._reward_worker import call_reward, normalize_result, resolve_function
from rollout.environments import create_environment, environment_names, toy_prompts
from rollout.environments.pool import RewardPool
from rollout.rewards.math_answer import last_boxed_answer, math_reward
from rollout.rewards.toy import repeat_char_reward

FLAKY = textwrap.dedent('''
    import os, time

    def flaky(*, prompt, completion, metadata):
        mode = metadata["mode"]
        if mode == "raise":
            raise RuntimeError("boom")
        if mode == "crash":
            os._exit(3)
        if mode == "hang":
            time.sleep(60)
        if mode == "nan":
            return float("nan")
        if mode == "str":
            return "high"
        if mode == "none":
            return None
        return {"reward": len(completion) / 10, "correct": True}
''')


@pytest.fixture(scope="module")
def math_env():
    env = create_environment("math", num_workers=1, timeout_s=30.0)
    yield env
    env.close()


def req(completion: str, **metadata) -> RewardRequest:
    return RewardRequest(prompt="p", completion=completion, metadata=metadata)


def test_math_answers_equal_under_math_verify(math_env):
    assert isinstance(math_env, Environment)
    golds = ["1/2", "0.5", "\\frac{1}{2}"]
    answers = ["so \\boxed{1/2}.", "The answer is $\\boxed{0.5}$", "\\boxed{\\frac{1}{2}}", "\\boxed{\\frac12}"]
    requests = [req(a, answer=g) for g in golds for a in answers]
    wrong = [req("\\boxed{1/3}", answer="0.5"), req("\\boxed{2}", answer="\\frac{1}{2}"), req("no idea", answer="7")]
    results = math_env.score(requests + wrong)
    assert [r.reward for r in results] == [1.0] * len(requests) + [0.0] * len(wrong)
    assert [r.correct for r in results] == [True] * len(requests) + [False] * len(wrong)
    assert math_env.last_metrics["reward/accuracy"] == pytest.approx(len(requests) / len(results))


def test_math_reward_without_answer_names_the_fields_the_row_has():
    """A dataset whose reference answer is under another name (e.g. "solution") is told which field to rename."""
    with pytest.raises(KeyError, match=r"no 'answer'.*found \['level', 'solution'\].*name that field 'answer'"):
        math_reward(prompt="1+1=", completion="\\boxed{2}", metadata={"solution": "2", "level": 1})


def test_boxed_extraction_takes_the_last_balanced_box():
    assert last_boxed_answer("first \\boxed{1} then \\boxed{\\frac{3}{4}} end") == "\\frac{3}{4}"
    assert last_boxed_answer("\\boxed{{a}+{b}}") == "{a}+{b}"
    assert last_boxed_answer("cut off \\boxed{\\frac{1}{2") is None
    assert last_boxed_answer("no box 42") is None
    # The last box decides, even when an earlier one holds the right answer.
    assert math_reward(prompt="", completion="\\boxed{5} no, \\boxed{6}", metadata={"answer": "5"})["reward"] == 0.0
    assert math_reward(prompt="", completion="it is 5", metadata={"answer": "5"}, require_boxed=True)["reward"] == 0.0
    assert math_reward(prompt="", completion="it is 5", metadata={"answer": "5"})["reward"] == 1.0


@pytest.mark.parametrize(("completion", "correct"), [("\\boxed{72}", True), ("So 72 clips.", True),
                                                    ("\\boxed{24}", False), ("\\boxed{48}", False)])
def test_a_gsm8k_worked_answer_is_scored_by_its_final_number(completion, correct):
    """GSM8K's `answer` field as it is (env.train_data=openai/gsm8k): the worked solution, its calculator notes and
    `#### 72`; the reference is the final number, not one of the intermediate ones (24, 48)."""
    gold = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
            "in April and May.\n#### 72")
    assert math_reward(prompt="", completion=completion, metadata={"answer": gold})["correct"] is correct


def test_a_final_box_cut_off_scores_zero():
    """The completion stopped inside its last box: that box was the final answer, so an earlier box (or a
    number in the text) holding the right one does not count."""
    for completion in ["\\boxed{5} then \\boxed{6", "it is 5, so \\boxed{5", "\\boxed{\\frac{5}{1}"]:
        assert math_reward(prompt="", completion=completion, metadata={"answer": "5"}) == \
            {"reward": 0.0, "correct": False}, completion
    assert math_reward(prompt="", completion="\\boxed{6} then \\boxed{5}", metadata={"answer": "5"})["reward"] == 1.0


def test_numpy_scalar_rewards_are_numbers():
    np = pytest.importorskip("numpy")
    assert normalize_result(np.float32(0.5)) == (0.5, None)
    assert normalize_result(np.int64(1)) == (1.0, None)
    assert normalize_result({"reward": np.float64(0.25), "correct": np.bool_(True)}) == (0.25, True)
    assert normalize_result(True) == (1.0, True)
    assert normalize_result(np.bool_(False)) == (0.0, False)
    for bad in ["1.0", b"1", None, np.float32("nan"), {"reward": float("inf")}]:
        with pytest.raises(TypeError, match="expected a finite float"):
            normalize_result(bad)
    with pytest.raises(TypeError, match=r"returned a dict without 'reward' \(keys: \['score'\]\); expected a finite"):
        normalize_result({"score": 1.0})  # it said "returned None"


def test_a_raising_reward_names_its_own_line_first(tmp_path, monkeypatch):
    """The logs keep a failed call's first line (cut at 300 characters): it names the user's file and line, which
    a traceback starting in this package's call_reward pushed past the cut."""
    (tmp_path / "user_reward.py").write_text(textwrap.dedent("""
        def score(*, prompt, completion, metadata):
            return helper(metadata)

        def helper(metadata):
            return metadata["answer"]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    from user_reward import score

    status, message = call_reward(score, {}, "p", "c", {})
    path = tmp_path / "user_reward.py"
    assert status == "error"
    assert message.splitlines()[0] == f"KeyError: 'answer' (at {path}:3 in score -> {path}:6 in helper)"
    assert "_reward_worker.py" not in message and 'return metadata["answer"]' in message
    assert call_reward(lambda **_: "1.0", {}, "p", "c", {}) == (
        "error", "TypeError: reward function returned '1.0'; expected a finite float (or bool, or a "
                 "dict/RewardResult with a finite 'reward')")
    assert call_reward(lambda completion: 1.0, {}, "p", "c", {})[1].endswith(
        "<lambda>() got an unexpected keyword argument 'prompt'")


def test_sys_exit_in_a_reward_is_a_failed_call_not_a_dead_worker():
    """It killed the worker process, respawned for every call (~35 s a step, 'reward worker died (exit code 1)')."""
    import sys

    def score(**_):
        sys.exit("no answer")

    status, message = call_reward(score, {}, "p", "c", {})
    assert status == "error" and message.startswith("SystemExit: no answer (at "), message


def test_repeat_char_reward_gives_partial_credit():
    meta = {"target": "7"}
    score = lambda c: repeat_char_reward(prompt="ab:7", completion=c, metadata=meta)  # noqa: E731
    assert score("7777") == pytest.approx(1.0)
    assert score("7777</s>") == pytest.approx(1.0)
    assert score("77") == pytest.approx(0.8 * 2 / 4)
    assert score("7x7y") == pytest.approx(0.8 * 2 / 4 + 0.2)
    assert score("77777") == pytest.approx(0.8)  # right characters, did not stop
    assert score("") == 0.0
    # The target is parsed from the prompt when metadata lacks it.
    assert repeat_char_reward(prompt="qq:3", completion="3333", metadata={}) == pytest.approx(1.0)


@pytest.mark.parametrize("task", ["repeat_char", "copy_digits"])
def test_a_toy_completion_cut_at_max_new_tokens_gets_no_stop_bonus(task, tokenizer):
    """The stop bonus is for stopping: "777<s>7<s>" decodes (special tokens dropped) to the 4 characters of a
    completion that stopped, and before the finish reason reached the reward a policy learnt exactly that (measured:
    with loss.kl_coef=0.05 and stop_bonus 0.5, every sample ended in <s> padding and none stopped)."""
    prompt, target = ("ab:7", "7777") if task == "repeat_char" else ("cp 7777:", "7777")
    padded = tokenizer.decode(tokenizer.encode("777<s>7<s>", add_special_tokens=False), skip_special_tokens=True)
    assert padded == target
    env = create_environment(task, num_workers=0)
    try:
        requests = [RewardRequest(prompt=prompt, completion=padded, metadata={"target": target[:1] if task ==
                                  "repeat_char" else target}, finish_reason=reason) for reason in ("length", "stop")]
        assert [r.reward for r in env.score(requests)] == pytest.approx([0.8, 1.0])
    finally:
        env.close()


FINISH_REASON_TAKERS = textwrap.dedent('''
    def named(*, prompt, completion, metadata, finish_reason=None):
        return {"stop": 1.0, "length": 0.5, None: 0.0}[finish_reason]

    def plain(*, prompt, completion, metadata):
        return 1.0

    def catch_all(*, prompt, completion, metadata, **kwargs):  # gets only its fn_kwargs
        return float(len(kwargs))
''')


def test_a_reward_function_gets_the_finish_reason_only_where_its_signature_names_it(tmp_path, monkeypatch):
    (tmp_path / "finish_rewards.py").write_text(FINISH_REASON_TAKERS)
    monkeypatch.syspath_prepend(str(tmp_path))
    requests = [RewardRequest(prompt="p", completion="c", finish_reason=reason) for reason in ("stop", "length", None)]
    for fn, expected in [("named", [1.0, 0.5, 0.0]), ("plain", [1.0] * 3), ("catch_all", [0.0] * 3)]:
        env = create_environment("function", fn=f"finish_rewards:{fn}", num_workers=1)
        try:
            results = env.score(requests)
            assert [r.error for r in results] == [None] * 3, fn
            assert [r.reward for r in results] == expected, fn
        finally:
            env.close()


@pytest.mark.parametrize("task", ["repeat_char", "copy_digits"])
def test_toy_prompts_split_train_and_held_out(task):
    train = toy_prompts(task, 200, split="train", seed=0)
    val = toy_prompts(task, 50, split="validation", seed=0)
    assert len(train) == 200 and len(val) == 50
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in val}
    assert toy_prompts(task, 20, seed=0) == toy_prompts(task, 20, seed=0)
    env = create_environment(task, num_workers=0)
    ideal = [RewardRequest(prompt=p["prompt"], completion=p["metadata"]["target"] * (4 if task == "repeat_char" else 1),
                           metadata=p["metadata"]) for p in val]
    assert [r.reward for r in env.score(ideal)] == pytest.approx([1.0] * len(val))


def test_pool_survives_crash_timeout_and_bad_values(tmp_path, monkeypatch):
    (tmp_path / "flaky_rewards.py").write_text(FLAKY)
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit sys.path
    env = create_environment("function", fn="flaky_rewards:flaky", num_workers=2, timeout_s=2.0)
    try:
        modes = ["ok", "raise", "crash", "nan", "str", "none", "ok"]
        results = env.score([req("x" * i, mode=m) for i, m in enumerate(modes)])
        assert [r.reward for r in results] == [0.0, 0, 0, 0, 0, 0, 0.6]
        assert [r.error is None for r in results] == [True, False, False, False, False, False, True]
        assert "RuntimeError: boom" in results[1].error and "exit code 3" in results[2].error
        assert "TypeError" in results[4].error and "None" in results[5].error
        assert env.last_metrics["reward/errors"] == 5 and env.last_metrics["reward/timeouts"] == 0
        hung = env.score([req("x", mode="hang")])
        assert "timeout" in hung[0].error and env.last_metrics["reward/timeouts"] == 1
        again = env.score([req("abc", mode="ok")] * 4)  # the pool replaced its dead workers
        assert [r.reward for r in again] == pytest.approx([0.3] * 4)
        assert env.last_metrics["reward/errors"] == 0 and env.last_metrics["reward/timeouts"] == 0
    finally:
        env.close()


SLOW_START = textwrap.dedent('''
    import os, time

    if os.path.exists(os.environ["SLOW_START_MARKER"]):  # a worker started after the marker: a slow import
        time.sleep(2.0)

    def reward(*, prompt, completion, metadata):
        if completion == "crash":
            os._exit(3)
        time.sleep(metadata.get("sleep", 0.0))
        return 1.0
''')


def test_a_slow_replacement_costs_other_calls_no_time(tmp_path, monkeypatch):
    """A crashed worker's replacement takes seconds to start (a spawned worker re-imports the caller's
    __main__: torch, in a trainer); the live worker scores the rest of the batch meanwhile, within the
    limit, and the replacement serves the next batch."""
    (tmp_path / "slow_start_rewards.py").write_text(SLOW_START)
    monkeypatch.syspath_prepend(str(tmp_path))
    marker = tmp_path / "slow-start"
    monkeypatch.setenv("SLOW_START_MARKER", str(marker))
    pool = RewardPool("slow_start_rewards:reward", num_workers=2, timeout_s=1.5)
    try:
        marker.touch()  # from here on, a worker takes > 2 s to start
        start = time.monotonic()
        outcomes = pool.run([("p", "crash", {}, {}), ("p", "ok", {"sleep": 0.3}, {})] + [("p", "ok", {}, {})] * 6)
        elapsed = time.monotonic() - start
        assert [o.status for o in outcomes] == ["crash"] + ["ok"] * 7
        assert elapsed < 2.5, elapsed  # did not wait for the replacement
        again = pool.run([("p", "ok", {"sleep": 0.5}, {})] * 2)
        assert [o.status for o in again] == ["ok", "ok"] and len(pool._workers) == 2
    finally:
        pool.close()


def test_a_worker_killed_while_idle_is_replaced_and_the_batch_scores(tmp_path, monkeypatch):
    """A worker SIGKILLed between batches (the OOM killer, an operator): the next batch's send hit a broken
    pipe and raised out of `run`, ending the whole training run (found by killing one in a live run); now the
    call goes to a replacement and every call of the batch scores."""
    import signal

    (tmp_path / "slow_start_rewards.py").write_text(SLOW_START)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("SLOW_START_MARKER", str(tmp_path / "never"))
    pool = RewardPool("slow_start_rewards:reward", num_workers=1, timeout_s=5.0)
    try:
        assert [o.status for o in pool.run([("p", "ok", {}, {})])] == ["ok"]
        dead = pool._workers[0].process
        os.kill(dead.pid, signal.SIGKILL)
        dead.join(timeout=5)
        assert [o.status for o in pool.run([("p", "ok", {}, {})] * 3)] == ["ok"] * 3
        assert len(pool._workers) == 1 and pool._workers[0].process.pid != dead.pid
    finally:
        pool.close()


SPAWNS_CHILD = textwrap.dedent('''
    import subprocess, sys

    def reward(*, prompt, completion, metadata):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", metadata["token"]])
        if metadata["wait"]:  # a code-execution reward whose program hangs
            child.wait()
        return 1.0
''')


def test_processes_a_reward_started_die_with_its_worker(tmp_path, monkeypatch):
    """A timed-out call's worker is killed with its process group, so a program the reward started does
    not outlive it (re-parented to PID 1, holding the caller's stdout); close() ends leftovers too."""
    psutil = pytest.importorskip("psutil")
    (tmp_path / "spawning_rewards.py").write_text(SPAWNS_CHILD)
    monkeypatch.syspath_prepend(str(tmp_path))
    tokens = {"hung": f"hung-{os.getpid()}-{time.time_ns()}", "left": f"left-{os.getpid()}-{time.time_ns()}"}

    def alive(token: str, wait_s: float = 0.0) -> list:
        deadline = time.monotonic() + wait_s
        while True:
            found = [p for p in psutil.process_iter(["cmdline", "status"])
                     if token in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE]
            if not found or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)

    pool = RewardPool("spawning_rewards:reward", num_workers=1, timeout_s=1.0)
    try:
        hung = pool.run([("p", "c", {"token": tokens["hung"], "wait": True}, {})])
        assert hung[0].status == "timeout"
        assert not alive(tokens["hung"], wait_s=3.0)
        left = pool.run([("p", "c", {"token": tokens["left"], "wait": False}, {})])
        assert left[0].status == "ok" and alive(tokens["left"])  # the check sees such a process
        pool.close()
        assert not alive(tokens["left"], wait_s=3.0)
    finally:
        pool.close()
        for token in tokens.values():
            for process in alive(token):
                process.kill()


def test_reward_module_in_the_launch_directory_imports(tmp_path, monkeypatch):
    """`my_reward:score` beside where the run started imports even when the caller is a script, whose
    sys.path holds the script's directory and not the working directory (the trainer with env.num_workers=0)."""
    (tmp_path / "launch_dir_reward.py").write_text("def score(*, prompt, completion, metadata):\n"
                                                    "    return 0.25 * len(completion)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    env = create_environment("function", fn="launch_dir_reward:score", num_workers=1)
    try:
        assert [r.reward for r in env.score([req("ab"), req("abcd")])] == [0.5, 1.0]
    finally:
        env.close()


def test_a_name_taken_by_another_environment_is_an_error(monkeypatch):
    """Two factories under one name: which one a run used depended on import order; now the second is refused."""
    from rollout.environments import base, register_environment

    monkeypatch.setattr(base.ENVIRONMENTS, "_classes", dict(base.ENVIRONMENTS._classes))

    class Mine:
        pass

    with pytest.raises(ValueError, match=r"environment 'math' is taken by rollout.environments.builtin:.*register "):
        register_environment("math")(Mine)
    assert create_environment("math").__class__.__name__ != "Mine"


def test_bad_names_are_clear_errors():
    with pytest.raises(ValueError, match=r"env.name: environment 'nope' is not registered; choose one of .*'math'.*'function' with env.kwargs.fn"):
        create_environment("nope")
    with pytest.raises(ValueError, match="pkg.module:function"):
        create_environment("function", fn="no_colon_here", num_workers=0)
    with pytest.raises(ValueError, match="no_such_module_xyz"):
        create_environment("function", fn="no_such_module_xyz:f", num_workers=1)
    assert {"math", "repeat_char", "copy_digits", "function"} <= set(environment_names())



def test_a_reward_module_whose_own_code_fails_names_the_function_and_the_error(tmp_path, monkeypatch):
    """A SyntaxError or a NameError at the module's top level came out as the bare message ("expected ':'
    (m.py, line 1)"), without the function or the module it was importing."""
    (tmp_path / "syntax_error_reward.py").write_text("def score(**kw)\n    return 1.0\n")
    (tmp_path / "name_error_reward.py").write_text("scale = undefined_name\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"^reward function 'syntax_error_reward:score': module 'syntax_error_reward' "
                                         r"does not import: SyntaxError: expected ':'"):
        resolve_function("syntax_error_reward:score")
    with pytest.raises(ValueError, match=r"^reward function 'name_error_reward:score': module 'name_error_reward' does "
                                         r"not import: NameError: name 'undefined_name' is not defined$"):
        resolve_function("name_error_reward:score")

POOL_SCRIPT = textwrap.dedent('''
    import sys, time
    from rollout.environments.pool import RewardPool
    pool = RewardPool("rollout.rewards.toy:repeat_char_reward", num_workers=1)
    assert pool.run([("ab:7", "7777", {}, {})])[0].reward == 1.0
    print(pool.dir, flush=True)
    if sys.argv[1] == "wait":
        time.sleep(120)
''')  # "exit": ends without close()


def test_pool_directory_goes_with_close_exit_and_killed_owner(tmp_path, monkeypatch):
    """No scratch directory outlives its pool: removed at close(), at interpreter exit, and (for an owner
    killed with SIGKILL, where nothing of it runs) by the next pool on the machine; a live pool's stays."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}

    def start(mode: str) -> tuple[subprocess.Popen, str]:
        proc = subprocess.Popen([sys.executable, "-c", POOL_SCRIPT, mode], env=env, stdout=subprocess.PIPE, text=True)
        return proc, proc.stdout.readline().strip()

    exited, exited_dir = start("exit")
    assert exited.wait(timeout=60) == 0 and exited_dir.startswith(str(temp)) and not os.path.exists(exited_dir)
    killed, killed_dir = start("wait")
    alive, alive_dir = start("wait")
    try:
        killed.kill()
        killed.wait(timeout=10)
        time.sleep(1)  # its worker sees the pipe close and exits
        assert os.path.isdir(killed_dir)  # nothing of a SIGKILLed process runs
        monkeypatch.setattr(tempfile, "tempdir", str(temp))
        pool = RewardPool("rollout.rewards.toy:repeat_char_reward", num_workers=1)
        assert not os.path.exists(killed_dir) and os.path.isdir(alive_dir) and os.path.isdir(pool.dir)
        pool.close()
        assert not os.path.exists(pool.dir)
        with pytest.raises(RuntimeError, match="closed"):
            pool.run([("ab:7", "7", {}, {})])
    finally:
        alive.kill()
        alive.wait(timeout=10)
    assert sorted(p.name for p in temp.iterdir()) == [os.path.basename(alive_dir)]


def test_an_installed_environment_is_found_by_its_entry_point(tmp_path, monkeypatch):
    """A package's `rl_core.environments` entry point makes its environment known in any process (the trainer's
    reward workers never import the user's module, so an in-process @register_environment is not seen there):
    listed, built with its kwargs, its decorator's prompt_fields kept; an undecorated class works as it is."""
    from rollout.environments import create_environment, environment_names, prompt_fields

    (tmp_path / "my_envs.py").write_text(
        "from rollout.environments import register_environment\n"
        "from rl_core.interfaces import RewardResult\n"
        "@register_environment('count_target_ep', prompt_fields={'target': 'the letter to count'})\n"
        "class CountTarget:\n"
        "    def __init__(self, bonus=0.0):\n        self.bonus = bonus\n"
        "    def score(self, requests):\n"
        "        return [RewardResult(reward=r.completion.count(r.metadata['target']) + self.bonus) for r in requests]\n"
        "class Plain(CountTarget):\n    pass\n")
    dist_info = tmp_path / "my_envs-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-envs\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[rl_core.environments]\ncount_target_ep = my_envs:CountTarget\n"
                                                "plain_ep = my_envs:Plain\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert {"count_target_ep", "plain_ep"} <= set(environment_names())
    assert prompt_fields("count_target_ep") == {"target": "the letter to count"}
    env = create_environment("count_target_ep", bonus=0.5)
    request = RewardRequest(prompt="p", completion="abca", metadata={"target": "a"})
    assert [r.reward for r in env.score([request])] == [2.5]
    assert prompt_fields("plain_ep") == {} and create_environment("plain_ep").score([request])[0].reward == 2.0
