"""benchmarks/science.py's statistics and report on made-up records: the 95% t-interval, the paired
differences, and where a run's code commit comes from."""

import json
import math
import subprocess

import pytest

from benchmarks import science


def test_t_interval_matches_the_textbook_values():
    mean, half, n = science.t_interval([1.0, 2.0, 3.0])
    assert (mean, n) == (2.0, 3) and half == pytest.approx(4.303 / math.sqrt(3))
    mean, half, n = science.t_interval([0.5])
    assert mean == 0.5 and math.isnan(half) and n == 1
    values = [float(v) for v in range(40)]  # df beyond the table: the normal quantile
    sd = math.sqrt(sum((v - 19.5) ** 2 for v in values) / 39)
    assert science.t_interval(values)[1] == pytest.approx(1.96 * sd / math.sqrt(40))


def record(variant, seed, final, start=0.1):
    return {"task": "wordmath", "variant": variant, "seed": seed, "max_steps": 80, "returncode": 0, "wall_s": 60.0,
            "command": "-m pacs train", "host": "h", "cpus": 2, "n_samples": 2, "ks": [1, 2],
            "evals": [{"step": 0, "eval_pass@1": start, "eval_pass@2": start},
                      {"step": 80, "eval_pass@1": final, "eval_pass@2": final}],
            "train": {"reward_last10": final, "reward_timeouts": 0.0}}


def test_report_pairs_the_seeds_and_marks_intervals_that_exclude_zero(tmp_path):
    pacs = {0: 0.30, 1: 0.40, 2: 0.50}
    grpo = {0: 0.20, 1: 0.31, 2: 0.39, 3: 0.9}  # seed 3 has no PACS run: left out of the pairs
    rows = [record("pacs", s, v) for s, v in pacs.items()] + [record("grpo", s, v) for s, v in grpo.items()]
    rows[0].update(code_commit="abc1234", cpu_model="Some CPU")  # PACS seed 0 ran elsewhere ...
    rows[3].update(code_commit="abc1234", cpu_model="Some CPU")  # ... and so did GRPO's: still a pair
    rows.append({**record("pacs", 4, 0.0), "returncode": 1})  # failed runs are left out
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert science.main(["report", "--out", str(tmp_path), "--runs-dir", str(tmp_path / "runs"),
                         "--note", "Ran on two machines."]) == 0
    assert science.main(["report", "--out", str(tmp_path), "--runs-dir", str(tmp_path / "runs")]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "Ran on two machines." in text  # the note is kept for later reports
    mean, half, _ = science.t_interval(list(pacs.values()))
    assert f"| pacs | 3 | 0.100 +- 0.000 | {mean:.3f} +- {half:.3f} |" in text
    assert "| grpo | 4 |" in text
    diffs = [pacs[s] - grpo[s] for s in pacs]  # 0.10, 0.09, 0.11: the interval excludes 0
    mean, half, _ = science.t_interval(diffs)
    assert f"| PACS - GRPO | 3 | {mean:+.3f} +- {half:.3f} * |" in text
    assert (tmp_path / "wordmath_pass_at_k.png").stat().st_size > 0
    assert "2 runs at commit abc1234 on Some CPU; 5 runs at commit an unrecorded commit on an unrecorded CPU" in text
    assert "--variants pacs grpo --seeds 0 1 2 3 &&" in text  # how to rerun this sweep
    assert "# PACS vs GRPO, across seeds" in text


def test_report_pairs_only_runs_of_one_machine_and_commit(tmp_path):
    """A seed run on two CPUs (or at two commits) is two independent draws, not a pair."""
    pacs = {0: 0.30, 1: 0.40, 2: 0.50}
    weightless = {0: 0.20, 1: 0.31, 2: 0.39}
    rows = [record("pacs", s, v) for s, v in pacs.items()] + [record("pacs_unweighted", s, v)
                                                                for s, v in weightless.items()]
    rows[2].update(cpu_model="Other CPU")  # PACS seed 2 ran on another machine than its unweighted run
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert science.main(["report", "--out", str(tmp_path), "--runs-dir", str(tmp_path / "runs")]) == 0
    text = (tmp_path / "report.md").read_text()
    mean, half, _ = science.t_interval([pacs[s] - weightless[s] for s in (0, 1)])
    assert f"| PACS class weights balanced - none | 2 | {mean:+.3f} +- {half:.3f}" in text
    assert "# PACS's class weights (balanced vs none), across seeds" in text
    assert "| pacs_unweighted | 3 |" in text


def test_code_commit_of_a_checkout_and_of_an_exported_copy(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "a.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(repo)]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert science.code_commit(str(repo)) == head
    (repo / "a.py").write_text("x = 2\n")
    assert science.code_commit(str(repo)) == head + "+edits"
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "COMMIT").write_text("abc1234\n")
    assert science.code_commit(str(copy)) == "abc1234"
    (copy / "COMMIT").unlink()
    assert science.code_commit(str(copy)) is None


def test_a_seed_run_at_two_commits_pairs_within_each(tmp_path):
    """Seed 0 of PACS at commit A (beside the unweighted run at A) and again at B (beside the kept-reference run
    at B): both pairs count; neither PACS run replaces the other."""
    rows = [record("pacs", 0, 0.30), record("pacs_unweighted", 0, 0.20), record("pacs", 0, 0.50),
            record("pacs_ref4", 0, 0.45)]
    for row, commit in zip(rows, "AABB"):
        row.update(code_commit=commit, cpu_model="Some CPU")
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert science.main(["report", "--out", str(tmp_path), "--runs-dir", str(tmp_path / "runs")]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| PACS class weights balanced - none | 1 | +0.100 +- nan |" in text
    assert "| PACS reference reset every 4 - every 1 rollout steps | 1 | -0.050 +- nan |" in text


def test_diagnostics_average_over_steps_and_by_the_reference_age(tmp_path):
    """A run's loss diagnostics: means over its steps (NaN steps left out), the gradient share also by the
    reference's age; the report tabulates them per variant (runs that did not log them are left out)."""
    rows = [{"step": s, "reward_mean": 0.1, "ref_age": float((s - 1) % 2), "psi_std": 0.1 * s,
             "frac_single_label_groups": 0.5, "single_label_grad_share": share}
            for s, share in ((1, float("nan")), (2, 0.6), (3, 0.0), (4, 0.8))]
    got = science.diagnostics(rows)
    assert got["psi_std_mean"] == pytest.approx(0.25)
    assert got["single_label_grad_share_mean"] == pytest.approx((0.6 + 0.0 + 0.8) / 3)
    assert got["single_label_grad_share_by_ref_age"] == {"0": pytest.approx(0.0), "1": pytest.approx(0.7)}
    assert science.diagnostics([{"step": 1, "reward_mean": 0.1}]) == {}  # an older run: nothing logged
    kept = record("pacs_ref4", 0, 0.3)
    kept["train"].update(got)
    reset = record("pacs", 0, 0.4)
    reset["train"].update(science.diagnostics([{**{k: v for k, v in r.items() if k != "ref_age"},
                                                "single_label_grad_share": 0.0} for r in rows]))
    older = record("pacs", 1, 0.5)  # no diagnostics: not in the table's mean
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (kept, reset, older)))
    assert science.main(["report", "--out", str(tmp_path), "--runs-dir", str(tmp_path / "runs")]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| pacs | 1 | 0.500 | 0.000 | 0.250 | - |" in text
    assert "| pacs_ref4 | 1 | 0.500 | 0.467 | 0.250 | 0: 0.000, 1: 0.700 |" in text


def test_any_objective_is_a_variant_by_its_name():
    """The GRPO family's variants run `pacs train --algo NAME`; any other objective optim.algo takes (a built-in
    one, a user's module:Class) is a variant by that name; anything else is refused before any run."""
    assert science.variant_overrides("dapo") == ["optim.algo=dapo"]
    assert science.variant_overrides("dr_grpo") == ["optim.algo=dr_grpo"]
    assert science.variant_overrides("gspo") == ["optim.algo=gspo"]
    assert science.variant_overrides("my_objectives:MyLoss") == ["optim.algo=my_objectives:MyLoss"]
    assert science.variant_overrides("pacs_sft") == science.VARIANTS["pacs_sft"]
    assert science.run_dir_name("embedded", "my_objectives:MyLoss", 3) == "embedded-my_objectives.MyLoss-s3"
    with pytest.raises(ValueError, match="optim.algo"):
        science.variant_overrides("ppo")
    with pytest.raises(SystemExit):
        science.main(["run", "--variants", "pacs", "ppo"])


def test_report_shows_the_grpo_family_beside_pacs(tmp_path):
    """DAPO and Dr.GRPO (and a user's objective) get their rows and their paired differences against PACS and GRPO,
    on the same seeds."""
    finals = {"pacs": 0.30, "grpo": 0.25, "dapo": 0.27, "dr_grpo": 0.22, "my_objectives:MyLoss": 0.10}
    rows = [record(variant, seed, final + 0.01 * seed) for variant, final in finals.items() for seed in range(3)]
    (tmp_path / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert science.main(["report", "--out", str(tmp_path), "--runs-dir", str(tmp_path / "runs")]) == 0
    text = (tmp_path / "report.md").read_text()
    for variant in finals:
        assert f"| {variant} | 3 |" in text
    for label, diff in (("PACS - GRPO", 0.05), ("PACS - DAPO", 0.03), ("PACS - Dr.GRPO", 0.08),
                        ("DAPO - GRPO", 0.02), ("Dr.GRPO - GRPO", -0.03), ("PACS - my_objectives:MyLoss", 0.20)):
        assert f"| {label} | 3 | {diff:+.3f} +- 0.000 * |" in text
    assert "--variants pacs grpo dapo dr_grpo my_objectives:MyLoss --seeds 0 1 2 &&" in text
    assert text.startswith("# PACS vs GRPO, and PACS vs DAPO, and PACS vs Dr.GRPO, across seeds")
