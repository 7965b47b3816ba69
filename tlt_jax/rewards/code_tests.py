"""What the `code` reward runs: a completion's program and its row's tests.

The program is the completion's last fenced code block (```python, ```py or a bare
fence; an unclosed last fence runs to the end), or the whole completion without one.
The tests come from the row, in the first of these layouts it has (a field that is None,
a column the row lacks, is absent):

  test_list (+ test_setup_code)   MBPP, KodCode: assert statements, each a test;
  test + entry_point              HumanEval: check(candidate), one test; the prompt is
                                  put before a program that lacks `def <entry_point>`;
  input_output, or tests          APPS, TACO, CodeContests, DeepCoder: JSON (or a dict)
                                  {"inputs": [...], "outputs": [...]}, compared on stdout
                                  line by line (trailing whitespace ignored), or by return
                                  value when it has "fn_name" (LeetCode's class Solution
                                  too); DeepCoder's list of {"input", "output"} as well;
  answer                          the same JSON as verl-format code datasets store it in
                                  reward_model.ground_truth (data.answer_field).

`sandbox.run` runs them; `rewards.CodeReward` scores the outcome.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any, Mapping

from tlt_jax import sandbox

TEST_FIELDS = ("test_list", "test + entry_point", "input_output", "tests", "answer")
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_PYTHON_FENCES = ("", "python", "py", "python3")


def extract_program(completion: str) -> str:
    """The last fenced Python (or bare) code block of a completion, else all of it."""
    blocks = [code for language, code in _FENCE.findall(completion) if language.lower() in _PYTHON_FENCES]
    return blocks[-1] if blocks else completion


def _prompt_text(prompt) -> str:
    """A prompt's text: itself, or a conversation's last user message."""
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else ""


def _parse_json(value, field: str):
    """A JSON string, a Python literal (verl's ground truth after str()) or a dict as is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except ValueError:
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError) as error:
        raise ValueError(f"field {field}={value!r:.80} is neither JSON nor a Python literal of "
                         '{"inputs": [...], "outputs": [...]}; fix the dataset\'s test column.') from error


def _text(value) -> str:
    return "\n".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def _io_suite(spec, field: str) -> sandbox.Suite:
    """Tests of the APPS / TACO / DeepCoder layout; `spec` already parsed."""
    if isinstance(spec, list) and all(isinstance(t, Mapping) and "input" in t for t in spec):  # DeepCoder's list
        spec = {"inputs": [t["input"] for t in spec], "outputs": [t.get("output", "") for t in spec]}
    if not (isinstance(spec, Mapping) and "inputs" in spec and "outputs" in spec):
        raise ValueError(f"field {field}={str(spec)[:80]!r} has no inputs and outputs; give "
                         '{"inputs": [...], "outputs": [...]} (with "fn_name" for call-based tests).')
    inputs, outputs = list(spec["inputs"]), list(spec["outputs"])
    if len(inputs) != len(outputs):
        raise ValueError(f"field {field} has {len(inputs)} inputs but {len(outputs)} outputs; give one output "
                         "per input.")
    if spec.get("fn_name"):
        return sandbox.Suite("call", [list(a) if isinstance(a, (list, tuple)) else [a] for a in inputs],
                             fn_name=str(spec["fn_name"]), expected=outputs)
    return sandbox.Suite("stdio", [_text(i) for i in inputs], expected=[_text(o) for o in outputs])


def row_tests(prompt, fields: Mapping[str, Any]) -> sandbox.Suite:
    """The tests of one row from its fields (see the module doc), with the prompt's text as
    a check row's preamble. Raises ValueError, one line, for a row with none of them."""
    present = {k: v for k, v in fields.items() if v is not None}
    if "test_list" in present:
        return sandbox.Suite("asserts", [str(t) for t in present["test_list"]],
                             setup=str(present.get("test_setup_code") or ""))
    if "test" in present and "entry_point" in present:
        return sandbox.Suite("check", [str(present["test"])], entry_point=str(present["entry_point"]),
                             preamble=_prompt_text(prompt))
    for field in ("input_output", "tests"):
        if field in present:
            return _io_suite(_parse_json(present[field], field), field)
    answer = present.get("answer")
    if isinstance(answer, str) and answer.strip()[:1] in ("{", "["):
        return _io_suite(_parse_json(answer, "answer"), "answer")
    raise ValueError(f"A row has none of the code reward's test fields ({', '.join(TEST_FIELDS)}); its fields: "
                     f"{', '.join(sorted(present)) or 'none'}. Give one of them (verl-format rows: "
                     "data.answer_field=reward_model.ground_truth).")


def program_of(completion: str, suite: sandbox.Suite) -> str:
    """The program a completion gives for `suite`, the suite's preamble before it where needed."""
    program = extract_program(completion)
    if suite.layout == "check" and not re.search(rf"def\s+{re.escape(suite.entry_point)}\s*\(", program):
        program = suite.preamble + program  # a HumanEval completion continues its prompt
    return program
