"""The math reward on the shipped set of tricky answers (tests/data/math_reward_cases.jsonl), its
timeouts (counted, scored 0) in the main thread and off it, and the fallback without math-verify."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from pacs.tasks import rewards
from pacs.tasks.rewards import MathVerifyReward, fallback_math_check, math_verify_available

CASES_PATH = os.path.join(os.path.dirname(__file__), "data", "math_reward_cases.jsonl")
with open(CASES_PATH) as fh:
    CASES = [json.loads(line) for line in fh if line.strip()]
QUICK = [c for c in CASES if not c["timeout"]]
PATHOLOGICAL = [c for c in CASES if c["timeout"]]

needs_math_verify = pytest.mark.skipif(not math_verify_available(), reason="math-verify is not installed")


def test_case_file_covers_every_kind():
    kinds = {c["kind"] for c in CASES}
    assert kinds >= {"boxed", "fraction", "interval", "units", "latex_vs_plain", "several_boxes", "no_answer",
                     "pathological"}
    assert {c["expected"] for c in QUICK} == {0.0, 1.0}


@needs_math_verify
@pytest.mark.parametrize("case", QUICK, ids=[f"{c['kind']}-{i}" for i, c in enumerate(QUICK)])
def test_tricky_answers(case):
    reward = MathVerifyReward(timeout_s=2)
    assert reward(case["response"], case["answer"]) == case["expected"], case["note"]
    counts = reward.pop_counts()
    assert counts == {"calls": 1, "timeouts": 0, "errors": 0}


# each pathological answer in a fresh interpreter, as a trainer's process meets its first ones; prints, per call,
# [reward, counts], and a cached repeat of the first answer last
FRESH_PROCESS_CHECK = r"""
import json, sys
from pacs.tasks.rewards import MathVerifyReward
cases = json.load(sys.stdin)
reward = MathVerifyReward(timeout_s=1)
calls = cases + cases[:1]
print(json.dumps([[reward(c["response"], c["answer"]), reward.pop_counts()] for c in calls]))
"""


@needs_math_verify
def test_pathological_answers_time_out_score_zero_and_are_counted():
    """In a fresh process (the suite's own long-lived process once counted one of them as checked, not timed out,
    while a fresh one never has: see the next test for what holds in any process)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS_CHECK], input=json.dumps(PATHOLOGICAL), text=True,
                          capture_output=True, timeout=300, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for case, (score, counts) in zip(PATHOLOGICAL, results):
        assert score == 0.0 and counts == {"calls": 1, "timeouts": 1, "errors": 0}, (case["note"], counts)
    # a cached timeout is counted again (it is still a response that could not be checked) but costs nothing
    assert results[-1] == [0.0, {"calls": 1, "timeouts": 1, "errors": 0}]


@needs_math_verify
def test_pathological_answers_score_zero_and_never_stall_in_any_process():
    """In this process, whatever ran in it before: each pathological answer scores 0, within its time limits
    (parse and comparison 1 s each, plus the one-time warm-up), and is counted."""
    reward = MathVerifyReward(timeout_s=1)
    reward("\\boxed{1}", "1")  # the one-time warm-up, outside the timed calls
    reward.pop_counts()
    for case in PATHOLOGICAL:
        started = time.monotonic()
        assert reward(case["response"], case["answer"]) == 0.0, case["note"]
        # a bound against a stall, not the 1 s limit: in the suite's long-lived process the 3000-level case
        # runs to its end (26-32 s measured in full fresh-clone runs; 1 s alone), which 30 s cut too close
        assert time.monotonic() - started < 90, case["note"]
    assert reward.pop_counts()["calls"] == len(PATHOLOGICAL)


@needs_math_verify
def test_off_the_main_thread_a_helper_process_checks_and_times_out():
    """math-verify's signal-based timeouts raise outside the main thread; the reward must not."""
    reward = MathVerifyReward(timeout_s=1)
    picked = [c for c in QUICK if c["kind"] in ("fraction", "several_boxes", "units")][:4] + PATHOLOGICAL[:1]
    results: list = []
    worker = threading.Thread(target=lambda: results.extend(reward(c["response"], c["answer"]) for c in picked))
    worker.start()
    worker.join(timeout=300)
    try:
        assert not worker.is_alive()
        assert results == [c["expected"] for c in picked]
        counts = reward.pop_counts()
        assert counts["calls"] == len(picked) and counts["timeouts"] == 1
        assert reward._helper is not None  # the helper process did the work
    finally:
        reward.close()


def test_fallback_without_math_verify(monkeypatch):
    monkeypatch.setattr(rewards, "math_verify_available", lambda: False)
    reward = MathVerifyReward()
    with pytest.warns(UserWarning, match="math-verify is not installed"):
        assert reward("so \\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}") == 1.0
    assert reward("the result is 3.0", "3") == 1.0
    assert reward("no answer here", "3") == 0.0
    assert fallback_math_check("\\boxed{4} not \\boxed{3}", "3") == 1.0  # last box
    assert reward.pop_counts() == {"calls": 3, "timeouts": 0, "errors": 0}


def test_cache_is_bounded_and_bad_timeout_refused():
    reward = MathVerifyReward(cache_size=3)
    for i in range(6):
        reward(f"\\boxed{{{i}}}", str(i))
    assert len(reward._cache) == 3
    with pytest.raises(ValueError, match="timeout_s must be an int >= 1"):
        MathVerifyReward(timeout_s=0.5)


@needs_math_verify
def test_task_reports_timeouts_for_the_trainer_metrics(tmp_path):
    """What the trainer logs per step: a math task's reward timeouts and errors since the last step."""
    from pacs.tasks import MathTask

    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"problem": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    task = MathTask(str(path), eval_path=str(path))
    task.reward_fn = MathVerifyReward(timeout_s=1)
    problem = task.eval_problems()[0]
    assert task.reward("\\boxed{1}", problem) == 1.0
    assert task.reward(PATHOLOGICAL[0]["response"], problem) == 0.0
    assert task.reward_metrics() == {"reward_timeouts": 1.0, "reward_errors": 0.0}
    assert task.reward_metrics() == {"reward_timeouts": 0.0, "reward_errors": 0.0}


@needs_math_verify
def test_first_check_in_a_fresh_process_is_not_timed_out_by_set_up():
    """math-verify builds its LaTeX parser on first use (about 2 s); that must not count against the
    first answer's 1 s limit (it did, under load, in the science sweep: see its report)."""
    import subprocess
    import sys

    code = ("from pacs.tasks.rewards import MathVerifyReward\n"
            "r = MathVerifyReward(timeout_s=1)\n"
            "print(r('so \\\\boxed{\\\\frac{3}{4}}', '0.75'), r.pop_counts()['timeouts'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1.0", "0"]


@needs_math_verify
def test_the_warm_up_without_a_timeout_prints_nothing():
    """math-verify warns "Timeout is disabled ..." on the console when called without a timeout, which only
    the warm-up does (on purpose): that line must not reach the user (issue #26)."""
    import subprocess
    import sys

    code = ("from pacs.tasks.rewards import MathVerifyReward\n"
            "print(MathVerifyReward(timeout_s=5)('so \\\\boxed{2}', '2'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1.0"]
    assert "Timeout is disabled" not in out.stderr + out.stdout


def test_without_math_verify_the_text_comparison_says_so_once(monkeypatch):
    """The fallback compares normalized text and plain numbers (\\frac{1}{2} against 0.5 scores 0): a run
    without math-verify installed learns against a weaker reward, and now it is told, once."""
    import warnings

    import pacs.tasks.rewards as rewards

    monkeypatch.setattr(rewards, "math_verify_available", lambda: False)
    reward = rewards.MathVerifyReward()
    with pytest.warns(UserWarning, match="math-verify is not installed"):
        assert reward("so \\boxed{2}", "2") == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reward("so \\boxed{\\frac{1}{2}}", "0.5") == 0.0
