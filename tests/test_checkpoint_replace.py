"""A checkpoint or an export that replaces one of the same name is never lost: a process killed between
moving the old one aside (``X.replaced.tmp``) and renaming the new one (``X.tmp``) into place left neither at
``X``, and the next write's cleanup of ``*.tmp`` directories deleted both. Now every checkpoint scan and the
next write put one back first (the new one when its manifest verifies, else the old one), and the next
export does the same. The kill is simulated at the rename that puts the new one in place (every rename from
there on fails, as in a dead process), and once with a real SIGKILL."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal

import pytest
import torch
import transformers
from tiny_models import save_tiny_qwen2

import pacs.run.checkpoint as ck
import pacs.run.durable as durable
from pacs.model.policy import load_policy
from pacs.run.export import export_hf, is_complete_export, recover_export


class Killed(BaseException):
    """The process died here: nothing after it runs (not even an ``except Exception``)."""


def die_at_rename_into(monkeypatch, final: str) -> None:
    """Every ``os.rename`` from the one that moves ``final + ".tmp"`` to ``final`` on raises :class:`Killed`."""
    real, dead = os.rename, {"now": False}

    def rename(src, dst):
        if str(dst) == final and str(src) == final + ".tmp":
            dead["now"] = True
        if dead["now"]:
            raise Killed(f"killed at rename {src} -> {dst}")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)


def files_writing(value: int):
    def write_files(tmp: str) -> None:
        ck.save_json({"value": value}, os.path.join(tmp, "state.json"))
        ck.save_json({"x": value}, os.path.join(tmp, "model.pt"))
    return write_files


def value_of(path: str) -> int:
    with open(os.path.join(path, "state.json")) as fh:
        return json.load(fh)["value"]


def killed_replacing_step_1(tmp_path, monkeypatch) -> str:
    """Step 1 written (value 1), then written again (value 2, a resumed run) and killed between the renames."""
    root = str(tmp_path / "checkpoints")
    ck.write_checkpoint_files(root, 1, files_writing(1))
    final = os.path.join(root, "step_000001")
    with monkeypatch.context() as patch:
        die_at_rename_into(patch, final)
        with pytest.raises(Killed):
            ck.write_checkpoint_files(root, 1, files_writing(2))
    return root


def test_a_kill_between_the_renames_of_a_replaced_checkpoint_keeps_the_step(tmp_path, monkeypatch):
    root = killed_replacing_step_1(tmp_path, monkeypatch)
    assert sorted(os.listdir(root)) == ["latest", "step_000001.replaced.tmp", "step_000001.tmp"]  # the killed state
    choice = ck.find_checkpoint(str(tmp_path))  # the resume scan puts the new one (its manifest verifies) back
    assert choice.step == 1 and not choice.skipped and value_of(choice.path) == 2
    assert ck.verify_checkpoint(choice.path) is None


def test_the_next_write_puts_the_step_back_before_it_cleans_up(tmp_path, monkeypatch):
    root = killed_replacing_step_1(tmp_path, monkeypatch)
    ck.write_checkpoint_files(root, 2, files_writing(3), keep=2)  # the cleanup of *.tmp deleted both
    assert sorted(os.listdir(root)) == ["latest", "step_000001", "step_000002"]
    assert [step for step, _ in ck.checkpoint_steps(str(tmp_path))] == [1, 2]
    assert value_of(os.path.join(root, "step_000001")) == 2
    assert ck.verify_checkpoint(os.path.join(root, "step_000001")) is None


def test_an_unverified_new_checkpoint_gives_the_old_one_back(tmp_path, monkeypatch):
    root = killed_replacing_step_1(tmp_path, monkeypatch)
    with open(os.path.join(root, "step_000001.tmp", "model.pt"), "ab") as fh:
        fh.write(b"damaged")
    assert ck.recover_checkpoints(root) == [os.path.join(root, "step_000001")]
    assert value_of(os.path.join(root, "step_000001")) == 1
    assert ck.find_checkpoint(str(tmp_path)).step == 1
    ck.write_checkpoint_files(root, 2, files_writing(3))
    assert sorted(os.listdir(root)) == ["latest", "step_000001", "step_000002"]


def _replace_step_1_and_die(root: str) -> None:
    real = os.rename

    def rename(src, dst):
        if str(src).endswith("step_000001.tmp"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(src, dst)

    os.rename = rename
    ck.write_checkpoint_files(root, 1, files_writing(2))


def test_sigkill_between_the_renames_then_resume_and_write_again(tmp_path):
    root = str(tmp_path / "checkpoints")
    ck.write_checkpoint_files(root, 1, files_writing(1))
    child = multiprocessing.get_context("fork").Process(target=_replace_step_1_and_die, args=(root,))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    assert "step_000001" not in os.listdir(root)
    assert ck.find_checkpoint(str(tmp_path)).step == 1
    ck.write_checkpoint_files(root, 2, files_writing(3))
    assert [step for step, _ in ck.checkpoint_steps(str(tmp_path))] == [1, 2]


def test_a_failed_second_rename_puts_the_old_checkpoint_back(tmp_path, monkeypatch):
    root = str(tmp_path / "checkpoints")
    ck.write_checkpoint_files(root, 1, files_writing(1))
    final, real = os.path.join(root, "step_000001"), os.rename

    def rename(src, dst):
        if str(dst) == final and str(src) == final + ".tmp":
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="Input/output error"):
        ck.write_checkpoint_files(root, 1, files_writing(2))
    assert value_of(final) == 1 and ck.verify_checkpoint(final) is None


def test_another_rank_recovering_between_the_renames_does_not_break_the_write(tmp_path, monkeypatch):
    """A rank's scan (its crash message's resume hint) may run while rank 0 is between its two renames: it
    promotes rank 0's verified step_X.tmp, and rank 0's own rename then finds it done."""
    root = str(tmp_path / "checkpoints")
    ck.write_checkpoint_files(root, 1, files_writing(1))
    final, real, raced = os.path.join(root, "step_000001"), os.rename, []

    def rename(src, dst):
        if str(dst) == final and str(src) == final + ".tmp" and not raced:
            raced.append(True)
            assert ck.recover_checkpoints(root) == [final]  # the other rank, first
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    assert ck.write_checkpoint_files(root, 1, files_writing(2)) == final
    assert sorted(os.listdir(root)) == ["latest", "step_000001"]
    assert value_of(final) == 2 and ck.verify_checkpoint(final) is None


def test_recovery_by_two_processes_at_once_keeps_the_first(tmp_path, monkeypatch):
    root = killed_replacing_step_1(tmp_path, monkeypatch)
    final = os.path.join(root, "step_000001")

    def complete_after_another_process_recovered(tmp):
        assert durable.recover_replaced(final, lambda path: True)  # it promoted the new one meanwhile
        return False  # this one saw the new one vanish: it would put the old one back, and must not

    assert not durable.recover_replaced(final, complete_after_another_process_recovered)
    assert value_of(final) == 2
    assert sorted(os.listdir(root)) == ["latest", "step_000001", "step_000001.replaced.tmp"]
    assert durable.recover_replaced(final, lambda path: True) is False  # nothing more to do


# ---------------------------------------------------------------------------------------------
# export_hf


def tiny_model_dir(path) -> str:
    return save_tiny_qwen2(path, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=1, head_dim=16, max_position_embeddings=32, tie_word_embeddings=True)


def exported_weight(path: str) -> torch.Tensor:
    loaded = transformers.AutoModelForCausalLM.from_pretrained(path)
    return loaded.get_input_embeddings().weight.detach()


@pytest.fixture
def policy(tmp_path):
    return load_policy(tiny_model_dir(tmp_path / "model"))


def test_a_kill_between_the_renames_of_an_export_is_recovered(tmp_path, monkeypatch, policy):
    out = str(tmp_path / "final_model")
    export_hf(policy, None, out)
    first = exported_weight(out)
    with torch.no_grad():
        policy.causal_lm.get_input_embeddings().weight.add_(1.0)
    with monkeypatch.context() as patch:
        die_at_rename_into(patch, out)
        with pytest.raises(Killed):
            export_hf(policy, None, out)
    # the previous export was moved aside, not deleted; the new one is complete
    assert sorted(os.listdir(tmp_path)) == ["final_model.replaced.tmp", "final_model.tmp", "model"]
    assert durable.recover_replaced(out, is_complete_export)
    torch.testing.assert_close(exported_weight(out), first + 1.0)

    # killed again; the new one is damaged this time: the previous export comes back
    with monkeypatch.context() as patch:
        die_at_rename_into(patch, out)
        with pytest.raises(Killed):
            export_hf(policy, None, out)
    os.remove(os.path.join(out + ".tmp", "config.json"))
    assert recover_export(out) and not recover_export(out)
    torch.testing.assert_close(exported_weight(out), first + 1.0)

    # a kill, then the next export (a resumed run's): it recovers first and leaves one export, nothing aside
    with monkeypatch.context() as patch:
        die_at_rename_into(patch, out)
        with pytest.raises(Killed):
            export_hf(policy, None, out)
    with torch.no_grad():
        policy.causal_lm.get_input_embeddings().weight.add_(1.0)
    export_hf(policy, None, out + "/")
    assert sorted(os.listdir(tmp_path)) == ["final_model", "model"]
    torch.testing.assert_close(exported_weight(out), first + 2.0)


def test_a_reader_of_an_export_killed_between_its_renames_puts_it_back(tmp_path, monkeypatch, policy):
    """pacs eval / pacs train --model final_model right after a kill: the export is put back before it is read."""
    from pacs.config import load_config
    from pacs.run.run_setup import check_config

    out = str(tmp_path / "final_model")
    export_hf(policy, None, out)
    with torch.no_grad():
        policy.causal_lm.get_input_embeddings().weight.add_(1.0)
    with monkeypatch.context() as patch:
        die_at_rename_into(patch, out)
        with pytest.raises(Killed):
            export_hf(policy, None, out)
    assert not os.path.exists(out)
    check_config(load_config(None, [f"model.path={out}", "rollout.engine=hf", "rollout.max_prompt_len=8",
                                    "rollout.max_new_tokens=8"]))
    torch.testing.assert_close(exported_weight(out), policy.causal_lm.get_input_embeddings().weight.detach())


def test_every_exported_file_is_fsynced_before_the_export_is_renamed_into_place(tmp_path, monkeypatch, policy):
    out = str(tmp_path / "final_model")
    export_hf(policy, None, out)
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(src, dst):
        events.append(("rename", str(src), str(dst)))
        return real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    export_hf(policy, None, out)
    into_place = events.index(("rename", out + ".tmp", out))
    synced = {event[1] for event in events[:into_place] if event[0] == "fsync"}
    written = {os.path.join(out + ".tmp", name) for name in os.listdir(out)}
    assert written and written <= synced, written - synced
    assert out + ".tmp" in synced
    assert ("rename", out, out + ".replaced.tmp") in events[:into_place]  # moved aside, not deleted first
    assert ("fsync", str(tmp_path)) in events[into_place:]  # the renames made durable
    assert sorted(os.listdir(tmp_path)) == ["final_model", "model"]
    shutil.rmtree(out)
