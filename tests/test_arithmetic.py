import pytest

from arbor.tasks.arithmetic import (
    SYSTEM_PROMPT, ArithmeticProblem, calculator, demonstration, generate_problems, is_correct,
    parse_answer,
)


@pytest.fixture(scope="module")
def train():
    return generate_problems(300, seed=0, split="train")


def test_generator_deterministic(train):
    assert generate_problems(300, seed=0, split="train") == train
    assert generate_problems(300, seed=1, split="train") != train
    assert len({p.question for p in train}) == len(train)


def test_splits_disjoint(train):
    test = generate_problems(300, seed=0, split="test")
    other = generate_problems(300, seed=7, split="test")
    train_q = {p.question for p in train}
    assert not train_q & {p.question for p in test + other}
    small = dict(min_ops=1, max_ops=1, max_operand=6)  # tiny space: disjointness must still hold
    a = {p.question for p in generate_problems(20, seed=3, split="train", **small)}
    b = {p.question for p in generate_problems(5, seed=3, split="test", **small)}
    assert not a & b
    with pytest.raises(ValueError):
        generate_problems(200, seed=0, split="test", **small)
    with pytest.raises(ValueError):
        generate_problems(1, seed=0, split="val")


def test_steps_chain_to_answer(train):
    for p in train:
        assert 1 <= len(p.steps) <= 3
        value = None
        for step in p.steps:
            if value is not None:
                assert step.startswith(str(value))
            value = int(calculator(step))
            assert abs(value) < 10_000
        assert value == p.answer
        expr = p.question.removeprefix("What is ").removesuffix("?")
        assert calculator(expr) == str(p.answer)
        assert set(expr) <= set("0123456789+-*() ")


def test_example_problem_shape():
    p = ArithmeticProblem("What is (17 + 25) * 3 - 8?", 118, ("17+25", "42*3", "126-8"))
    assert calculator("(17 + 25) * 3 - 8") == "118"
    assert [calculator(s) for s in p.steps] == ["42", "126", "118"]


@pytest.mark.parametrize("expr,want", [
    ("17+25", "42"), ("-5*3", "-15"), ("3 - -4", "7"), ("-(2+3)*(4-10)", "30"),
    ("((1))", "1"), ("  7 * 6 ", "42"), ("0-9999", "-9999"), ("+3", "3"), ("(" * 99 + "1" + ")" * 99, "1"),
])
def test_calculator_ok(expr, want):
    assert calculator(expr) == want


@pytest.mark.parametrize("expr", [
    "__import__('os')", "2**100", "a+1", "1/2", "7//2", "7%2", "1.5+1", "0x10", "True+1",
    "", "1+", "(1", "'a'*3", "[1]", "1 if 1 else 2", "10**13", "9" * 13, "1" + "*999999" * 30,
    "(" * 150 + "1" + ")" * 150, "1000000*1000000*10", "print(1)", "x = 1", "1;2",
])
def test_calculator_rejects(expr):
    out = calculator(expr)
    assert out.startswith("error: "), (expr, out)


def test_calculator_never_raises():
    for bad in [None, 5, "-" * 199 + "1", "\x00", "1\n+2"]:
        assert isinstance(calculator(bad), str)


def test_parse_answer():
    assert parse_answer("Answer: 118") == 118
    assert parse_answer("so Answer:-7.") == -7
    assert parse_answer("Answer: 3\nAnswer:  42 done") == 42
    assert parse_answer("Answer: 12 then Answer: ?") is None
    assert parse_answer("Answer: 1.5") is None
    assert parse_answer("Answer: 1,000") is None
    assert parse_answer("answer is 5") is None
    assert parse_answer("") is None


def test_demonstration_and_is_correct(train):
    p = next(p for p in train if len(p.steps) == 3)
    msgs = demonstration(p)
    assert [m["role"] for m in msgs] == ["system", "user"] + ["assistant", "tool"] * 3 + ["assistant"]
    assert msgs[0]["content"] == SYSTEM_PROMPT and "calc" in SYSTEM_PROMPT and "Answer:" in SYSTEM_PROMPT
    assert msgs[1]["content"] == p.question
    for i, step in enumerate(p.steps):
        call, result = msgs[2 + 2 * i], msgs[3 + 2 * i]
        assert call["tool_calls"] == [{"type": "function", "function": {"name": "calc", "arguments": {"expr": step}}}]
        assert result["content"] == calculator(step)
    assert msgs[-1]["content"] == f"Answer: {p.answer}"
    assert is_correct(p, msgs[-1]["content"])
    assert not is_correct(p, f"Answer: {p.answer + 1}")
    assert not is_correct(p, "I don't know")


def test_sloppy_solver_answers_short_problems_without_the_tool(train):
    problems = train[:600]
    short = [p for p in problems if len(p.steps) <= 2]
    assert all(len(demonstration(p, mental_rate=1.0)) == 3 for p in short)          # system, user, answer
    assert all(demonstration(p, mental_rate=1.0) == demonstration(p) for p in problems if len(p.steps) == 3)
    assert all(demonstration(p, mental_rate=0.0) == demonstration(p) for p in problems)
    mental = [p for p in problems if len(demonstration(p, mental_rate=0.5)) == 3]
    assert 0.3 < len(mental) / len(short) < 0.7
    assert mental == [p for p in problems if len(demonstration(p, mental_rate=0.5)) == 3]  # deterministic
    assert all(len(demonstration(p, mental_rate=1.0, mental_max_steps=3)) == 3 for p in problems)
    for p in problems[:50]:
        assert is_correct(p, demonstration(p, mental_rate=0.5)[-1]["content"])
    with pytest.raises(ValueError, match="mental_rate"):
        demonstration(problems[0], mental_rate=1.5)
