"""`pacs eval` is never lost: chunks of problems journaled as they finish, an interrupted evaluation
resumed from its journal to the report of one never interrupted (pacs/eval/journal.py)."""

import json
import os
import random

import pytest

import pacs.cli as cli
from pacs.eval.evaluate import run_eval
from pacs.eval.journal import JOURNAL_NAME, EvalJournal
from pacs.tasks.base import Problem


class Tok:
    """Token i is the character chr(48 + i); EOS is 1."""

    eos_token_id = 1

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) - 48 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(48 + i) for i in ids if not (skip_special_tokens and i == 1))


class SeededEngine:
    """Samples like the HF engine: row j of a call (prompt j // n) draws from a generator seeded with
    ``seed + j``; here a digit answer, right a third of the time. Counts calls; ``fail_at``: that call raises."""

    def __init__(self, fail_at=None):
        self.calls, self.fail_at = 0, fail_at

    def generate(self, prompts, n, *, temperature, top_p, max_new_tokens, stop_token_ids, seed=None):
        self.calls += 1
        if self.calls == self.fail_at:
            raise KeyboardInterrupt  # the evaluation killed in the middle
        return [[[random.Random(seed + i * n + j).randrange(10) + 2, 1] for j in range(n)]
                for i in range(len(prompts))]


class DigitTask:
    def reward(self, text, problem):
        return float(text == problem.answer)


PROBLEMS = [Problem(prompt=f"{i}", answer=chr(48 + 2 + i % 10)) for i in range(7)]
OPTIONS = dict(n_samples=4, temperature=1.0, ks=(1, 2, 4), max_new_tokens=3, stop_token_ids=[1], seed=11)


def evaluate(engine, **extra):
    return run_eval(engine, DigitTask(), Tok(), PROBLEMS, **OPTIONS, **extra)


def test_chunks_sample_what_one_call_samples():
    """Chunk c starting at problem i samples with seed + i * n: with the HF engine's row seeds the records
    equal those of one call over every problem, whatever the chunk size."""
    whole = evaluate(SeededEngine())
    assert 0 < whole.metrics["accuracy"] < 1
    for chunk in (1, 2, 3, 7, 50):
        engine = SeededEngine()
        assert evaluate(engine, chunk_problems=chunk).records == whole.records
        assert engine.calls == -(-len(PROBLEMS) // chunk)


def test_an_interrupted_evaluation_resumes_from_its_journal(tmp_path, capsys):
    settings = {"model": "m", **OPTIONS}
    uninterrupted = evaluate(SeededEngine(), chunk_problems=2)
    with pytest.raises(KeyboardInterrupt):
        evaluate(SeededEngine(fail_at=3), chunk_problems=2, journal=EvalJournal(str(tmp_path), settings))
    lines = open(tmp_path / JOURNAL_NAME).read().splitlines()
    assert len(lines) == 1 + 4  # the header and the first two chunks' problems
    with open(tmp_path / JOURNAL_NAME, "a") as handle:
        handle.write('{"index": 4, "prom')  # a torn write: dropped
    engine = SeededEngine()
    journal = EvalJournal(str(tmp_path), settings, say=print)
    assert "resuming: 4 problems already done" in capsys.readouterr().out
    resumed = evaluate(engine, chunk_problems=2, journal=journal)
    assert engine.calls == 2  # problems 4-5 and 6 only
    assert resumed.records == uninterrupted.records and resumed.metrics == uninterrupted.metrics
    journal.finish()
    assert not os.path.exists(tmp_path / JOURNAL_NAME)


def test_a_journal_of_other_settings_is_not_resumed(tmp_path, capsys):
    evaluate(SeededEngine(), chunk_problems=2, journal=EvalJournal(str(tmp_path), {"seed": 1}))
    engine = SeededEngine()
    journal = EvalJournal(str(tmp_path), {"seed": 2}, say=print)
    assert "other settings: moved to" in capsys.readouterr().out
    evaluate(engine, chunk_problems=2, journal=journal)
    assert engine.calls == 4
    header = json.loads(open(tmp_path / JOURNAL_NAME).readline())
    assert header == {"settings": {"seed": 2}}
    # the other evaluation's samples are kept aside, not destroyed
    kept = open(tmp_path / (JOURNAL_NAME + ".old")).read().splitlines()
    assert json.loads(kept[0]) == {"settings": {"seed": 1}} and len(kept) == 1 + len(PROBLEMS)


def test_chunk_problems_must_be_a_positive_int():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="chunk_problems must be an int >= 1 or None"):
            evaluate(SeededEngine(), chunk_problems=bad)


@pytest.mark.slow
def test_pacs_eval_killed_and_run_again_writes_the_uninterrupted_report(tmp_path, monkeypatch, capsys):
    """The CLI end to end (HF engine, the embedded task, chunks of 2 problems): Ctrl-C in the third chunk,
    the same command again finishes the rest and writes what one uninterrupted `pacs eval` writes."""
    from pacs.config import Config
    from pacs.rollout.hf import HFGenerateEngine
    from pacs.tasks.embedded import build_model, build_tokenizer

    model = tmp_path / "model"
    build_model(Config().task, len(build_tokenizer()), seed=3).save_pretrained(model)
    build_tokenizer().save_pretrained(model)
    monkeypatch.setattr(cli, "EVAL_CHUNK_SEQUENCES", 4)  # 2 samples: 2 problems a chunk
    argv = ["eval", "--model", str(model), "--n-samples", "2", "--temperature", "1", "--k", "1", "--k", "2",
            "advanced.task.digits=1", "eval.num_problems=7", "rollout.max_new_tokens=3", "rollout.engine=hf",
            "advanced.plot=false"]

    def report(eval_dir):
        assert cli.main([*argv, "--eval-dir", str(eval_dir)]) == 0
        captured = capsys.readouterr()
        printed = json.loads(captured.out.strip().splitlines()[-1])
        lines = [json.loads(line) for line in open(printed["problems_path"])]
        assert not os.path.exists(os.path.join(eval_dir, JOURNAL_NAME))  # removed once the outputs are written
        return lines, {k: v for k, v in printed.items() if not k.endswith("_path")}

    expected = report(tmp_path / "whole")
    generate, calls = HFGenerateEngine.generate, []

    def killed_in_chunk_3(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(HFGenerateEngine, "generate", killed_in_chunk_3)
    assert cli.main([*argv, "--eval-dir", str(tmp_path / "killed")]) == 130
    monkeypatch.setattr(HFGenerateEngine, "generate", generate)
    journal = tmp_path / "killed" / JOURNAL_NAME
    assert (f"pacs eval: interrupted after 4 of 7 problems, which are kept in {journal}: the same command again "
            "continues from there") in capsys.readouterr().err
    resumed_calls = []

    def counted(self, *args, **kwargs):
        resumed_calls.append(1)
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(HFGenerateEngine, "generate", counted)
    assert report(tmp_path / "killed") == expected
    assert len(resumed_calls) == 2  # problems 4-5 and 6: the first 4 came from the journal


@pytest.mark.slow
def test_sigterm_during_pacs_eval_says_what_is_kept_and_exits_143(tmp_path, monkeypatch, capsys):
    """A scheduler's SIGTERM in the third chunk: the line Ctrl-C gets (what the journal keeps, how to go on)
    and the shell's code for SIGTERM (issue #26; it ended with 143 and no word)."""
    import signal

    from pacs.config import Config
    from pacs.rollout.hf import HFGenerateEngine
    from pacs.tasks.embedded import build_model, build_tokenizer

    model = tmp_path / "model"
    build_model(Config().task, len(build_tokenizer()), seed=3).save_pretrained(model)
    build_tokenizer().save_pretrained(model)
    monkeypatch.setattr(cli, "EVAL_CHUNK_SEQUENCES", 4)  # 2 samples: 2 problems a chunk
    generate, calls = HFGenerateEngine.generate, []

    def terminated_in_chunk_3(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return generate(self, *args, **kwargs)

    class NotHandledByPacsEval(Exception):
        pass

    def unhandled(signum, frame):  # what SIGTERM does here unless pacs eval handles it (not: end pytest)
        raise NotHandledByPacsEval

    monkeypatch.setattr(HFGenerateEngine, "generate", terminated_in_chunk_3)
    previous = signal.signal(signal.SIGTERM, unhandled)
    try:
        code = cli.main(["eval", "--model", str(model), "--n-samples", "2", "--temperature", "1",
                         "advanced.task.digits=1",
                         "eval.num_problems=7", "rollout.max_new_tokens=3", "rollout.engine=hf", "advanced.plot=false",
                         "--eval-dir", str(tmp_path / "eval")])
        assert signal.getsignal(signal.SIGTERM) is unhandled  # put back
    finally:
        signal.signal(signal.SIGTERM, previous)
    journal = tmp_path / "eval" / JOURNAL_NAME
    assert code == 143
    assert (f"pacs eval: SIGTERM received after 4 of 7 problems, which are kept in {journal}: the same command "
            "again continues from there") in capsys.readouterr().err
