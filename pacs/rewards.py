"""Verifiable 0/1 rewards: exact match, and math answers (math-verify when installed).

Every reward takes the decoded response text and the reference answer and returns 0.0 or 1.0.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the answer."""
    return float(response.strip() == str(answer).strip())


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (braces balanced), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed{") - 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a solution: the last \\boxed{} content, else the last number."""
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalize(answer: str) -> str:
    text = answer.strip().strip("$").replace(" ", "").replace("\\!", "")
    text = re.sub(r"\\(?:text|mathrm)\{([^}]*)\}", r"\1", text)
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").rstrip(".")
    return text


def math_verify_available() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def math_reward(response: str, answer: str) -> float:
    """1.0 when the response's final answer equals ``answer``.

    Uses the ``math-verify`` package (symbolic equivalence) when installed, otherwise compares the
    extracted answer after light normalization (and numerically when both sides are numbers).
    """
    if math_verify_available():
        from math_verify import parse, verify

        gold = parse(f"${answer}$" if "\\boxed" not in answer else answer)
        guess = parse(response)
        try:
            return float(bool(verify(gold, guess)))
        except Exception:  # math-verify raises on unparsable input; such an answer is wrong
            return 0.0
    found = extract_answer(response)
    if found is None:
        return 0.0
    a, b = _normalize(found), _normalize(str(answer))
    if a == b:
        return 1.0
    try:
        return float(abs(float(a) - float(b)) < 1e-9)
    except ValueError:
        return 0.0
