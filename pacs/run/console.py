"""What a run prints: the trainer's own lines and progress bar; third-party chatter only on request.

By default (:func:`quiet_third_party` with ``verbose=False``) vLLM logs only errors, transformers
and huggingface_hub neither log below errors nor draw progress bars, torch's C++ warnings and
library Future/Deprecation warnings are hidden. ``--verbose`` leaves all of it as the libraries
set it.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

_quiet = False


def quiet_third_party(verbose: bool) -> None:
    """Silence third-party logs, warnings and progress bars for this process (see module doc).

    Call before vLLM, transformers or torch is imported: several of them read the environment
    once, at import."""
    global _quiet
    if verbose:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
        return
    _quiet = True
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module=r"(torch|transformers|vllm)\b")
    # vllm.triton_utils warns at import, before vLLM configures its logging ("Triton is installed, but
    # doesn't include CPU backend"): Python's last-resort handler would print it
    for name in ("transformers", "torch.distributed", "urllib3", "filelock", "vllm.triton_utils.importing"):
        logging.getLogger(name).setLevel(logging.ERROR)
    hide_progress_bars()


def hide_progress_bars() -> None:
    """Switch transformers' and huggingface_hub's progress bars off again when quiet.

    Needed after a vLLM engine starts: vLLM 0.32 leaves a second ``transformers.utils.logging``
    module behind (the one ``save_pretrained`` then uses), with progress bars on."""
    if not _quiet:
        return
    try:
        from huggingface_hub.utils import disable_progress_bars
        from transformers.utils import logging as hf_logging
    except ImportError:  # transformers is only needed by train/eval, which import it later
        return
    disable_progress_bars()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    for name, module in list(sys.modules.items()):
        if name.endswith("transformers.utils.logging") and hasattr(module, "disable_progress_bar"):
            module.disable_progress_bar()
