"""StopSignals on its own: what a signal does inside the block, a second signal, the handlers after it.
The whole trainer under a signal: tests/test_trainer_e2e.py (1 process), tests/test_trainer_fsdp.py (2 ranks)."""

import os
import signal

import pytest
import torch

from pacs.stop_signals import STOP_SIGNALS, StopSignals


@pytest.mark.parametrize("stop_signal", STOP_SIGNALS)
def test_a_signal_sets_the_flag_and_says_so_once(stop_signal):
    before = signal.getsignal(stop_signal)
    notices = []
    with StopSignals(notice=notices.append) as stop_signals:
        assert stop_signals.agreed(1, torch.device("cpu")) is None
        os.kill(os.getpid(), stop_signal)
        assert stop_signals.received == stop_signal.name
        assert stop_signals.agreed(1, torch.device("cpu")) == stop_signal.name
    assert notices == [stop_signal.name]
    assert signal.getsignal(stop_signal) is before  # put back


def test_a_second_ctrl_c_acts_at_once():
    with StopSignals() as stop_signals:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop_signals.received == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_first_signal_is_the_one_reported():
    with StopSignals() as stop_signals:
        os.kill(os.getpid(), signal.SIGUSR1)
        # a different second signal acts at once too; SIGINT's default raises here instead of ending pytest
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert stop_signals.received == "SIGUSR1"
