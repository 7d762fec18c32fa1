"""Built-in multi-step arithmetic task with a calculator tool, written against the public API: rows
(``rows``), a tool (``calc``: a typed Python function with a docstring) and an Arbor-form reward
(``reward(prompt, completion, **row)``) — what ``arbor train task=arithmetic`` trains on, and what
``examples/arithmetic`` writes to files.

A problem is a left-to-right chain v0 op1 b1 op2 b2 ... with ops in {+, -, *} and operands
in 1..max_operand, written with the fewest parentheses that keep that order, e.g.
"What is (17 + 25) * 3 - 8?" with steps ("17+25", "42*3", "126-8") and answer 118.

Invariants:
- `generate_problems` is a pure function of its arguments (no global RNG, no hash seed).
- Splits are a partition by a SHA-256 hash of the question text, so "train" and "test"
  never share a question for any seeds; questions are unique within one call.
- Every intermediate value v satisfies |v| < 10_000, and chaining `calculator` over
  `steps` (each step's left operand is the previous result) reproduces `answer`.
- `calculator` never raises and never calls eval().
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from dataclasses import dataclass

from arbor.tasks.splits import split_of

MAX_VALUE = 10_000          # bound on |intermediate value| of generated problems
CALC_MAX_ABS = 10**12       # calculator rejects any literal or result beyond this
CALC_MAX_LEN = 200          # calculator rejects longer inputs
_OPS = ("+", "-", "*")

SYSTEM_PROMPT = "Compute one step at a time with the calc tool, then reply Answer: N."


@dataclass(frozen=True)
class ArithmeticProblem:
    question: str           # e.g. "What is (17 + 25) * 3 - 8?"
    answer: int
    steps: tuple[str, ...]  # calculator inputs in order, e.g. ("17+25", "42*3", "126-8")




def _random_problem(rng: random.Random, n_ops: int, max_operand: int) -> ArithmeticProblem | None:
    value = rng.randint(1, max_operand)
    expr, top = str(value), None    # top: the last (lowest-precedence, top-level) op in expr
    steps = []
    for _ in range(n_ops):
        op, b = rng.choice(_OPS), rng.randint(1, max_operand)
        new = value + b if op == "+" else value - b if op == "-" else value * b
        if abs(new) >= MAX_VALUE:
            return None
        steps.append(f"{value}{op}{b}")
        if op == "*" and top in ("+", "-"):
            expr = f"({expr})"
        expr = f"{expr} {op} {b}"
        top = op
        value = new
    return ArithmeticProblem(question=f"What is {expr}?", answer=value, steps=tuple(steps))


def generate_problems(n: int, seed: int, split: str = "train", min_ops: int = 1, max_ops: int = 3,
                      max_operand: int = 50) -> list[ArithmeticProblem]:
    """`n` distinct problems of `split` ("train" or "test"), deterministic in all arguments.

    Raises ValueError for a bad split or range, or when the problem space is too small to
    supply `n` distinct questions of that split.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if not 1 <= min_ops <= max_ops or max_operand < 1 or n < 0:
        raise ValueError(f"bad ranges: n={n} min_ops={min_ops} max_ops={max_ops} max_operand={max_operand}")
    rng = random.Random(f"arbor-arithmetic:{seed}:{split}")
    seen, out = set(), []
    for _ in range(200 * n + 1000):
        if len(out) == n:
            break
        p = _random_problem(rng, rng.randint(min_ops, max_ops), max_operand)
        if p is None or p.question in seen or split_of(p.question) != split:
            continue
        seen.add(p.question)
        out.append(p)
    if len(out) < n:
        raise ValueError(f"could only find {len(out)} of {n} distinct {split} problems; widen the ranges")
    return out


class _CalcError(Exception):
    pass


def _eval(node: ast.AST) -> int:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant):
        if type(node.value) is not int:
            raise _CalcError(f"only integers are allowed, got {node.value!r}")
        v = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval(node.operand)
        v = -v if isinstance(node.op, ast.USub) else v
    elif isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        a, b = _eval(node.left), _eval(node.right)
        v = a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
    elif isinstance(node, ast.BinOp):
        raise _CalcError(f"unsupported operator {type(node.op).__name__}; use only + - *")
    elif isinstance(node, ast.Name):
        raise _CalcError(f"names are not allowed ({node.id})")
    elif isinstance(node, ast.Call):
        raise _CalcError("function calls are not allowed")
    else:
        raise _CalcError(f"unsupported syntax {type(node).__name__}")
    if abs(v) > CALC_MAX_ABS:
        raise _CalcError(f"number too large (|value| > {CALC_MAX_ABS})")
    return v


def calculator(expression: str) -> str:
    """Value of an integer expression with + - * and parentheses, as a string, or
    "error: <why>". Never raises; never uses eval()."""
    try:
        if not isinstance(expression, str):
            return "error: expression must be a string"
        if len(expression) > CALC_MAX_LEN:
            return f"error: expression longer than {CALC_MAX_LEN} characters"
        expr = expression.strip()
        if not expr:
            return "error: empty expression"
        try:
            tree = ast.parse(expr, mode="eval")
        except SyntaxError:
            return "error: invalid syntax"
        value = _eval(tree)
        if not re.fullmatch(r"[0-9+\-*()\s]+", expr):   # e.g. 0x10, 1_000
            return "error: only decimal integers, + - * and parentheses are allowed"
        return str(value)
    except _CalcError as e:
        return f"error: {e}"
    except Exception as e:  # RecursionError, MemoryError, ...: the tool must never crash a rollout
        return f"error: {type(e).__name__}"


_ANSWER = re.compile(r"\s*([+-]?\d{1,30})(?!\d|\.\d|,\d)")


def parse_answer(text: str) -> int | None:
    """The integer right after the last "Answer:" (e.g. "Answer: -12."), else None.
    Decimals ("1.5") and grouped numbers ("1,000") give None."""
    i = text.rfind("Answer:")
    if i < 0:
        return None
    m = _ANSWER.match(text, i + len("Answer:"))
    return int(m.group(1)) if m else None


def is_correct(problem: ArithmeticProblem, final_text: str) -> bool:
    return parse_answer(final_text) == problem.answer


def calc(expr: str) -> str:
    """Evaluate an integer expression.

    Args:
        expr: integers with + - * and parentheses, e.g. (17+25)*3
    """
    return calculator(expr)


def reward(prompt, completion: str, answer, **row) -> float:
    """1.0 when the integer after the last "Answer:" of the final turn equals the row's ``answer``."""
    return float(parse_answer(completion) == int(answer))


def tool_call(name: str, arguments: dict) -> dict:
    """An OpenAI-format assistant message calling one tool (the chat template renders the call)."""
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": name, "arguments": arguments}}]}


def rows(n: int, seed: int, split: str = "train", mental_rate: float = 0.0, **options) -> list[dict]:
    """``n`` dataset rows: ``prompt`` (the question), ``answer`` and ``messages`` (the demonstration)."""
    return [{"prompt": p.question, "answer": p.answer, "messages": demonstration(p, mental_rate)}
            for p in generate_problems(n, seed, split, **options)]


def demonstration(problem: ArithmeticProblem, mental_rate: float = 0.0, mental_max_steps: int = 2) -> list[dict]:
    """The solver's chat: system, user(question), then per step an assistant turn calling ``calc``
    with the step and a "tool" turn with its value, then "Answer: N".

    ``mental_rate`` > 0 makes the solver answer the way a strong human does: on that fraction of
    the short problems (at most ``mental_max_steps`` steps) it skips the tool and replies
    "Answer: N" at once, the steps done in its head (always correctly); longer problems it always
    works with the tool. Which problems is a pure function of the question, so a demonstration
    is still deterministic. A student too small for mental arithmetic imitates the shortcut and
    fails: the gap RL closes in ``make demo``.
    """
    if not 0.0 <= mental_rate <= 1.0:
        raise ValueError(f"mental_rate must be in [0, 1], got {mental_rate}")
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": problem.question}]
    mental = len(problem.steps) <= mental_max_steps and _unit_hash(problem.question) < mental_rate
    for step in () if mental else problem.steps:
        messages.append(tool_call("calc", {"expr": step}))
        messages.append({"role": "tool", "content": calculator(step)})
    messages.append({"role": "assistant", "content": f"Answer: {problem.answer}"})
    return messages


def _unit_hash(text: str) -> float:
    """A uniform number in [0, 1) from the SHA-256 of ``text``."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64
