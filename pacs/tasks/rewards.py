"""Verifiable 0/1 rewards: exact match, and math answers checked by math-verify.

Every reward takes the decoded response text and the reference answer and returns 0.0 or 1.0.
A math reward never raises and never stalls a run: an answer that math-verify cannot parse or
compare scores 0, and so does one whose parsing or comparison runs past ``timeout_s`` (5 s, as
math-verify's own default; wall-clock limits, so a starved CPU can trip them too); both are counted
(:meth:`MathVerifyReward.pop_counts`) so the trainer can log them. math-verify's one-time set-up
(about 2 s for its LaTeX parser) runs before the first timed check.

math-verify's own timeouts use ``signal.alarm``, which only works in the main thread of the main
interpreter (elsewhere it raises ``ValueError``). :class:`MathVerifyReward` therefore checks
answers in the calling process when called from the main thread (the trainer's case: every rank's
loop runs there) and, from any other thread, in a helper process that is killed and restarted when
it overruns a hard deadline.
"""

from __future__ import annotations

import logging
import multiprocessing
import re
import threading
import warnings
from collections import OrderedDict

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def exact_match(response: str, answer: str) -> float:
    """1.0 when the response, stripped of surrounding whitespace, equals the answer."""
    return float(response.strip() == str(answer).strip())


_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")  # \boxed{, \boxed {, \fbox{
_BARE_BOX = re.compile(r"\\boxed[ \t]+([^\s${}]+)")  # \boxed 5 (LaTeX takes the next token)


def extract_boxed(text: str) -> str | None:
    """Content of the last box in ``text``, or None: ``\\boxed{...}`` (braces balanced; also ``\\boxed {``
    and ``\\fbox{``) or a bare ``\\boxed 5``, whichever comes last."""
    braced, bare = list(_BOX.finditer(text)), list(_BARE_BOX.finditer(text))
    if bare and (not braced or bare[-1].start() > braced[-1].start()):
        return bare[-1].group(1)
    if not braced:
        return None
    depth, i = 0, braced[-1].end() - 1
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


def fallback_math_check(response: str, answer: str) -> float:
    """Without math-verify: the extracted answer equals ``answer`` after light normalization
    (or numerically, when both are plain numbers)."""
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


_WARMED_UP = False


def _warm_up_math_verify() -> None:
    """Parse and compare once without a timeout: the first call builds math-verify's LaTeX parser
    (about 2 s, longer on a busy machine), which must not count against an answer's time limit."""
    global _WARMED_UP
    if _WARMED_UP:
        return
    from math_verify import LatexExtractionConfig, parse, verify

    # without a timeout on purpose: math-verify's warning about that ("Timeout is disabled ...", once per
    # process, on the console) is about these two calls only, every later one has its timeout
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_not_the_timeout_warning)
    gold = parse("\\boxed{\\frac{1}{2}}", extraction_config=(LatexExtractionConfig(),), parsing_timeout=None)
    verify(gold, parse("$0.5$", parsing_timeout=None), timeout_seconds=None)
    _WARMED_UP = True


def _not_the_timeout_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Timeout is disabled")


def math_verify_check(response: str, answer: str, timeout_s: int) -> tuple[float, str]:
    """(reward, status) of one response, in this thread (which must be the main thread).

    The gold answer is wrapped in ``\\boxed{}`` and read as LaTeX; the response's last
    ``\\boxed{}`` is read as LaTeX, and a response without one as a plain expression or LaTeX (the
    public PACS code's settings). status is "ok", "timeout" (parse
    or comparison ran past ``timeout_s`` seconds) or "error" (math-verify raised, or could not read the
    reference answer).
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from math_verify.errors import TimeoutException

    gold_text = answer if "\\boxed" in answer else "\\boxed{" + answer + "}"
    try:
        _warm_up_math_verify()
        gold = parse(gold_text, extraction_config=(LatexExtractionConfig(),), parsing_timeout=timeout_s,
                     raise_on_error=True)
        if len(gold) < 2:  # no expression read, only the text: try it as a plain expression (GSM8K's
            # "... #### 72" reads as 72)
            gold = parse(answer, extraction_config=(ExprExtractionConfig(),), parsing_timeout=timeout_s,
                         raise_on_error=True)
        last_box = extract_boxed(response)
        if last_box is not None:  # several boxes: the last one is the final answer (math-verify alone
            # would read "\\boxed{3} ... \\boxed{4}" as the set {3, 4})
            guess = parse("\\boxed{" + last_box + "}", extraction_config=(LatexExtractionConfig(),),
                          parsing_timeout=timeout_s, raise_on_error=True)
        else:
            guess = parse(response, extraction_config=(ExprExtractionConfig(), LatexExtractionConfig()),
                          parsing_timeout=timeout_s, raise_on_error=True)
        if not gold:  # a reference math-verify cannot read (e.g. "... #### 72"): the data's fault, counted
            return 0.0, "error"
        if not guess:
            return 0.0, "ok"
        return float(bool(verify(gold, guess, timeout_seconds=timeout_s, raise_on_error=True))), "ok"
    except TimeoutException:
        return 0.0, "timeout"
    except Exception:  # noqa: BLE001 - an answer math-verify cannot handle is a wrong answer
        return 0.0, "error"


def _worker_loop(conn, timeout_s: int) -> None:
    """Helper process: check (response, answer) pairs from ``conn`` in its own main thread."""
    _warm_up_math_verify()
    conn.send("ready")
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        if item is None:
            return
        conn.send(math_verify_check(item[0], item[1], timeout_s))


class _HelperProcess:
    """One spawned helper process running :func:`_worker_loop`; killed when it overruns."""

    def __init__(self, timeout_s: int, startup_s: float = 60.0):
        self.timeout_s, self.startup_s = timeout_s, startup_s
        self.lock = threading.Lock()
        self.process = self.conn = None

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_loop, args=(child, self.timeout_s), daemon=True)
        self.process.start()
        child.close()
        if not self.conn.poll(self.startup_s):
            self._kill()
            raise RuntimeError("the math-verify helper process did not start")
        self.conn.recv()

    def _kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.join()
        self.process = self.conn = None

    def check(self, response: str, answer: str) -> tuple[float, str]:
        # math-verify's own alarms fire after timeout_s per parse/compare; the hard deadline covers
        # the rest (a computation stuck in C code never returns to the signal handler)
        deadline = 4 * self.timeout_s + 1
        with self.lock:
            try:
                if self.process is None or not self.process.is_alive():
                    self._start()
                self.conn.send((response, answer))
                if self.conn.poll(deadline):
                    return self.conn.recv()
                self._kill()
                return 0.0, "timeout"
            except (OSError, EOFError, RuntimeError):
                self._kill()
                return 0.0, "error"

    def close(self) -> None:
        with self.lock:
            if self.process is not None and self.process.is_alive():
                try:
                    self.conn.send(None)
                except OSError:
                    pass
            self._kill()


class MathVerifyReward:
    """Math answer reward (math-verify when installed, else :func:`fallback_math_check`).

    ``reward(response, answer)`` is 1.0 when the response's final answer (``\\boxed{}`` or the
    last expression) equals ``answer`` symbolically. Timeouts and math-verify errors give 0.0 and
    are counted; results are cached per (response, answer) pair (``cache_size`` most recent),
    which matters for small models that repeat their answers.
    """

    def __init__(self, timeout_s: int = 5, cache_size: int = 65536):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int) or timeout_s < 1:
            raise ValueError(f"timeout_s must be an int >= 1 (signal.alarm counts whole seconds), got {timeout_s!r}")
        self.timeout_s, self.cache_size = timeout_s, cache_size
        self._cache: OrderedDict[tuple[str, str], tuple[float, str]] = OrderedDict()
        self._counts = {"calls": 0, "timeouts": 0, "errors": 0}
        self._lock = threading.Lock()
        self._helper: _HelperProcess | None = None
        self._warned_fallback = False

    def _compute(self, response: str, answer: str) -> tuple[float, str]:
        if not math_verify_available():
            if not self._warned_fallback:
                self._warned_fallback = True
                warnings.warn("math-verify is not installed: math answers are compared as normalized text and "
                              "plain numbers (\\frac{1}{2} against 0.5 scores 0); pip install math-verify",
                              stacklevel=3)
            return fallback_math_check(response, answer), "ok"
        if threading.current_thread() is threading.main_thread():
            return math_verify_check(response, answer, self.timeout_s)
        with self._lock:
            if self._helper is None:
                self._helper = _HelperProcess(self.timeout_s)
        return self._helper.check(response, answer)

    def __call__(self, response: str, answer: str) -> float:
        key = (str(response), str(answer))
        with self._lock:
            hit = self._cache.get(key)
        if hit is None:
            hit = self._compute(*key)
            with self._lock:
                self._cache[key] = hit
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        reward, status = hit
        with self._lock:
            self._counts["calls"] += 1
            if status == "timeout":
                self._counts["timeouts"] += 1
            elif status == "error":
                self._counts["errors"] += 1
        return reward

    def pop_counts(self) -> dict[str, int]:
        """Calls, timeouts and errors since the last call of this method."""
        with self._lock:
            counts, self._counts = self._counts, {"calls": 0, "timeouts": 0, "errors": 0}
        return counts

    def close(self) -> None:
        """Stop the helper process, if one was started."""
        if self._helper is not None:
            self._helper.close()
            self._helper = None


math_reward = MathVerifyReward()
"""The shared math reward used by the math tasks (``math_reward(response, answer) -> 0.0 | 1.0``)."""
