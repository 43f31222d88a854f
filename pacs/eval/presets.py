"""``pacs eval --preset NAME``: the evaluation protocol of the PACS paper as config overrides.

The public PACS code (github.com/ritzz-ai/PACS, ``scripts/inference.sh`` and
``src/preprocess_dataset.py``) samples N = 32 responses per problem at temperature 0.6, top-p 0.95,
up to 4096 new tokens, with the chat template and the instruction below appended to each problem,
and reports pass@k for k = 1, 2, 4, ... up to N; the paper's figures go to pass@256 (N = 256).
Rewards: math-verify on the ``\\boxed{}`` answer (:mod:`pacs.tasks.rewards`).

A preset is a list of ``key=value`` overrides applied before the command line's own overrides and
flags, which therefore win (e.g. ``--preset paper --n-samples 8``).
"""

from __future__ import annotations

PAPER_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
PAPER_SAMPLING = ["eval.temperature=0.6", "advanced.eval.top_p=0.95"]


def _escaped(text: str) -> str:
    """``text`` inside a ``str.format`` template (task.prompt_template): braces doubled."""
    return text.replace("{", "{{").replace("}", "}}")


def _ks(n: int) -> str:
    return "eval.ks=[" + ",".join(str(2 ** i) for i in range(n.bit_length()) if 2 ** i <= n) + "]"


PRESETS: dict[str, list[str]] = {
    # the paper's sampling on any math file, prompts and lengths as configured (fits tiny models)
    "math": ["task.name=math", "eval.n_samples=32", _ks(32), "eval.num_problems=1000000", *PAPER_SAMPLING],
    # the public code's full protocol (N = 32) for a real chat model
    "paper": ["task.name=math", "eval.n_samples=32", _ks(32), "eval.num_problems=1000000", *PAPER_SAMPLING,
              "task.use_chat_template=true", "task.prompt_template={prompt} " + _escaped(PAPER_INSTRUCTION),
              "rollout.max_prompt_len=1024", "rollout.max_new_tokens=4096"],
}
PRESETS["paper256"] = [o for o in PRESETS["paper"] if not o.startswith(("eval.n_samples", "eval.ks"))] + [
    "eval.n_samples=256", _ks(256)]


def preset_overrides(name: str | None) -> list[str]:
    """The overrides of preset ``name`` (none for None)."""
    if name is None:
        return []
    if name not in PRESETS:
        raise ValueError(f"--preset must be one of {', '.join(PRESETS)}; got {name!r}")
    return list(PRESETS[name])
