"""pass@k (unbiased estimator) against brute force, and the evaluation driver."""

import itertools
import math
import random

import pytest

from pacs.eval.evaluate import evaluate, mean_pass_at_k, pass_at_k
from pacs.tasks.arithmetic import AdditionTask


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """Fraction of all k-subsets of n samples (c correct) that hold at least one correct sample."""
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_matches_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12)


def test_pass_at_k_large_n_matches_closed_form():
    rng = random.Random(0)
    for _ in range(20):
        n = rng.randint(50, 300)
        c, k = rng.randint(0, n), rng.randint(1, n)
        expected = 1.0 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_pass_at_k_bad_input():
    with pytest.raises(ValueError, match="k must be in"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="0 <= c <= n"):
        pass_at_k(4, 5, 1)
    with pytest.raises(TypeError, match="k must be an int"):
        pass_at_k(4, 1, 1.5)
    with pytest.raises(ValueError, match="empty"):
        mean_pass_at_k([], 4, 1)


class OracleEngine:
    """Answers problem i correctly in the first ``right[i]`` of its n samples."""

    def __init__(self, tokenizer, problems, right):
        self.tok, self.problems, self.right = tokenizer, problems, right

    def generate(self, prompts, n, *, temperature, top_p, max_new_tokens, stop_token_ids, seed=None):
        out = []
        for p, right in zip(self.problems, self.right):
            good = self.tok(p.answer, add_special_tokens=False)["input_ids"] + stop_token_ids
            bad = self.tok(p.answer + "9", add_special_tokens=False)["input_ids"] + stop_token_ids
            out.append([good if j < right else bad for j in range(n)])
        return out


def test_evaluate_counts_and_pass_at_k():
    from pacs.tasks.embedded import build_tokenizer

    tok = build_tokenizer()
    task = AdditionTask(digits=2, seed=0, eval_size=6)
    problems = task.eval_problems()
    right = [0, 1, 2, 4, 4, 3]
    engine = OracleEngine(tok, problems, right)
    result = evaluate(engine, task, tok, problems, n_samples=4, temperature=1.0, ks=(1, 2, 4),
                      max_new_tokens=5, stop_token_ids=[tok.eos_token_id])
    assert result["accuracy"] == pytest.approx(sum(right) / 24)
    for k in (1, 2, 4):
        assert result[f"pass@{k}"] == pytest.approx(sum(brute_force_pass_at_k(4, c, k) for c in right) / 6)
    with pytest.raises(ValueError, match="greedy"):
        evaluate(engine, task, tok, problems, n_samples=2, temperature=0.0, max_new_tokens=5,
                 stop_token_ids=[2])


def test_rewards_without_a_verdict_are_counted_per_problem_and_in_the_metrics():
    """A reference math-verify cannot read scores every sample 0; that is an error of the data, counted (it
    passed as a wrong answer, status ok, so the report never showed it). A GSM8K-style "... #### 72" reads as
    72 (it scored 0, status ok, whatever the answer)."""
    pytest.importorskip("math_verify")
    from pacs.tasks.base import Problem
    from pacs.tasks.embedded import build_tokenizer
    from pacs.tasks.math_data import MathTask
    from pacs.tasks.rewards import math_reward, math_verify_check

    assert math_verify_check("so \\boxed{72}", "She sold 48 + 24 = 72 clips. #### 72", 10) == (1.0, "ok")
    assert math_verify_check("so \\boxed{72}", "???", 10) == (0.0, "error")
    assert math_verify_check("so \\boxed{73}", "72", 10) == (0.0, "ok")  # a wrong answer is no error

    class Rows(MathTask):
        def __init__(self, problems):
            self._eval, self.reward_fn = problems, math_reward

    tok = build_tokenizer()
    problems = [Problem(prompt="1", answer="72"), Problem(prompt="2", answer="???")]
    engine = OracleEngine(tok, [Problem(prompt="1", answer="72"), Problem(prompt="2", answer="72")], [2, 2])
    result = evaluate(engine, Rows(problems), tok, problems, n_samples=2, temperature=1.0, max_new_tokens=5,
                      stop_token_ids=[tok.eos_token_id])
    assert (result["accuracy"], result["reward_errors"], result["reward_timeouts"]) == (0.5, 2.0, 0.0)
