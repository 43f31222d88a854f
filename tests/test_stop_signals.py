"""StopSignals on its own: what a signal does inside the block, a second signal, the handlers after it.
The whole trainer under a signal: tests/test_trainer_e2e.py (1 process), tests/test_trainer_fsdp.py (2 ranks)."""

import os
import signal

import pytest
import torch

from pacs.run import stop_signals as module
from pacs.run.stop_signals import STOP_SIGNALS, StopSignals

CPU = torch.device("cpu")


@pytest.mark.parametrize("stop_signal", STOP_SIGNALS)
def test_a_signal_sets_the_flag_and_says_so_once(stop_signal, capfd):
    before = signal.getsignal(stop_signal)
    with StopSignals(notice_prefix="[test]") as stop_signals:
        assert stop_signals.agreed(1, CPU) == (None, False, False)
        os.kill(os.getpid(), stop_signal)
        os.kill(os.getpid(), stop_signal)  # at once again: the same request delivered twice, ignored
        assert stop_signals.received == stop_signal.name
        assert stop_signals.agreed(1, CPU) == (stop_signal.name, False, False)
        assert stop_signals.agreed(1, CPU, out_of_time=True) == (stop_signal.name, True, False)
        assert stop_signals.agreed(1, CPU, checkpoint_due=True).checkpoint_due
    assert capfd.readouterr().err.count(f"[test] {stop_signal.name} received: the step in progress") == 1
    assert signal.getsignal(stop_signal) is before  # put back


def test_a_second_signal_later_acts_at_once(monkeypatch):
    """Ctrl-C, then Ctrl-C again more than REPEAT_SECONDS later: KeyboardInterrupt, as without the handler;
    a different signal counts as a second one too, and the first is the one reported."""
    clock = iter([100.0, 110.0, 200.0, 210.0])
    monkeypatch.setattr(module.time, "monotonic", lambda: next(clock))
    with StopSignals() as stop_signals:
        os.kill(os.getpid(), signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert stop_signals.received == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with StopSignals() as stop_signals:
        os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(KeyboardInterrupt):  # SIGINT's own action: raises here instead of ending pytest
            os.kill(os.getpid(), signal.SIGINT)
        assert stop_signals.received == "SIGUSR1"


def test_an_ignored_signal_stays_ignored():
    """A process started with SIGINT ignored (a script's `&`, nohup) keeps it ignored: no stop request."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopSignals() as stop_signals:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGINT)
            assert stop_signals.received is None
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def _agree_on_two_ranks(rank: int, port: int, out_dir: str) -> None:
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        with StopSignals() as stop_signals:
            # rank 0 alone finds a checkpoint due, rank 1 alone is out of time
            agreement = stop_signals.agreed(2, CPU, out_of_time=rank == 1, checkpoint_due=rank == 0)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(list(agreement), f)
    finally:
        dist.destroy_process_group()


def test_two_ranks_agree_on_every_flag(tmp_path):
    """What one rank decides (a time-based checkpoint, max_minutes) every rank does after the same step."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_agree_on_two_ranks, args=(port, str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert results == [[None, True, True], [None, True, True]]
