"""Dataset families: prompts with reference answers from a team's own file, scored by a built-in scorer.

`runner tasks from-dataset` validates a JSONL or CSV file and writes a task package around it (the rows
normalised into data.jsonl, a family class configured here); a plan then names it like any task package.
Every row is {"id", "prompt", "answer", "split"} (and, for the regex scorer, the "pattern" of accepted
replies; optionally its own "system" prompt and "metadata", kept in the item's reference); a policy
answers on its last line as 'Answer: <answer>'.
A tool-using dataset adds tools.json (the tools' names, descriptions and parameters, from the team's
sidecar file) and the team's module implementing them (`initial_state(row)` optional, one function per
tool called as `function(state, **arguments)` and returning text); a row's "calls" are the tool calls of
a correct episode (its demonstration and scripted cases), and with "require_tool_call" success needs one.
Scorers: exact (case, surrounding space and final punctuation ignored), numeric (within an absolute
tolerance), choice (the option letter), regex (the reply matches the row's pattern in full), math
(mathematical equivalence by Hugging Face's math-verify: 1/2, 0.5 and \\frac{1}{2} are one answer).
math-verify is not installed here: a dataset package with the math scorer declares it, locked in
MATH_LOCK, and the host and every stack import it from the package's folder."""

from __future__ import annotations

import importlib
import json
import random
import re
import threading
from pathlib import Path
from typing import Any

from .base import Score, TaskItem, ToolParam, ToolSpec, Transcript

SCORERS = ("exact", "numeric", "choice", "regex", "math")
MATH_REQUIREMENT = "math-verify[antlr4_13_2]==0.9.0"
MATH_LOCK = Path(__file__).with_name("math-verify.lock")
ANSWER = re.compile(r"^Answer:\s*(.*?)\s*$")
NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")
LETTER = re.compile(r"^\(?([A-Za-z])\)?(?:[.):]|\s|$)")


def final_answer(text: str) -> str | None:
    """What follows 'Answer:' on the reply's last non-empty line, or None."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    match = ANSWER.match(lines[-1]) if lines else None
    return match.group(1) if match else None


def normalise(text: str) -> str:
    return " ".join(text.casefold().split()).rstrip(".!?")


def number(text: str) -> float | None:
    cleaned = text.replace(",", "").strip()
    return float(cleaned) if NUMBER.match(cleaned) else None


def letter(text: str) -> str | None:
    match = LETTER.match(text.strip())
    return match.group(1).upper() if match else None


def math_expression(text: str) -> list | None:
    """math-verify's parse of an answer (LaTeX with or without $...$, or a plain expression), or None
    when it reads nothing."""
    try:
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
    except ImportError:
        raise RuntimeError(f"the math scorer needs {MATH_REQUIREMENT}: declare it in the task package's "
                           "dependencies with its lock (runner tasks from-dataset --scorer math does)") from None
    text = text.strip()
    wrapped = text if text.startswith("$") or "\\boxed" in text else f"${text}$"
    # math-verify's timeouts use SIGALRM, which only the main thread may set
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    parsed = parse(wrapped, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                   fallback_mode="no_fallback", parsing_timeout=timeout)
    return parsed or None


def math_equal(reply: str, reference: str) -> bool:
    from math_verify import verify

    gold, answer = math_expression(reference), math_expression(reply)
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    return gold is not None and answer is not None and verify(gold, answer, timeout_seconds=timeout)


def correct(scorer: str, reply: str, reference: str, tolerance: float = 1e-6, pattern: str | None = None) -> bool:
    """Whether a final answer matches the reference under the scorer."""
    if scorer == "exact":
        return normalise(reply) == normalise(reference)
    if scorer == "numeric":
        got, want = number(reply), number(reference)
        return got is not None and want is not None and abs(got - want) <= tolerance
    if scorer == "choice":
        return letter(reply) is not None and letter(reply) == letter(reference)
    if scorer == "regex":
        return re.fullmatch(pattern if pattern is not None else re.escape(reference), reply.strip()) is not None
    if scorer == "math":
        return math_equal(reply, reference)
    raise ValueError(f"unknown scorer {scorer!r}; scorers are {', '.join(SCORERS)}")


def wrong_answer(scorer: str, reference: str) -> str:
    """A final answer the scorer must reject (the service stage's known-bad case)."""
    if scorer == "numeric":
        return str((number(reference) or 0) + 1)
    if scorer == "choice":
        return "B" if letter(reference) == "A" else "A"
    if scorer == "math":
        return f"({reference}) + 1"
    return f"not {reference}" if scorer == "exact" else "\u2205"


def tool_specs(tools: list[dict[str, Any]]) -> tuple[ToolSpec, ...]:
    """ToolSpecs from tools.json entries {"name", "description", "parameters": [{"name", "type", "description"}]}."""
    return tuple(ToolSpec(tool["name"], tool["description"],
                          tuple(ToolParam(p["name"], p["type"], p.get("description", "")) for p in tool["parameters"]))
                 for tool in tools)


def tool_row(row: dict[str, Any]) -> dict[str, Any]:
    """What a dataset's tool module sees of its row: never the answer."""
    return {"id": row["id"], "prompt": row["prompt"], "metadata": row.get("metadata", {})}


def run_tool(module: Any, state: dict[str, Any], name: str, arguments: dict[str, Any]) -> str:
    """A tool's result text; a call the tool refuses (a wrong argument, an exception) is an error result."""
    try:
        return str(getattr(module, name)(state, **arguments))
    except Exception as error:  # the team's code: any failure is the policy's tool error, not a crash
        return f"error: {type(error).__name__}: {error}"


class DatasetFamily:
    """A family over normalised rows (data.jsonl beside the generated package's module)."""

    scorer_version = 1
    synthetic = False

    def __init__(self, name: str, rows: Path, scorer: str, *, tolerance: float = 1e-6,
                 system_prompt: str = "Answer on the last line as 'Answer: <answer>'.",
                 tools: Path | None = None, implementation: str | None = None):
        if scorer not in SCORERS:
            raise ValueError(f"unknown scorer {scorer!r}; scorers are {', '.join(SCORERS)}")
        self.name, self.scorer, self.tolerance, self.system_prompt = name, scorer, tolerance, system_prompt
        declared = json.loads(tools.read_text()) if tools is not None else {"tools": [], "require_tool_call": False}
        self.tools = tool_specs(declared["tools"])
        self.require_tool_call = bool(declared["require_tool_call"])
        self.implementation = implementation
        self.rows = [json.loads(line) for line in rows.read_text().splitlines() if line.strip()]
        self.rows_by_task_id = {f"{name}/{row['id']}": row for row in self.rows}
        self.by_split: dict[str, list[dict[str, Any]]] = {}
        for row in self.rows:
            self.by_split.setdefault(row["split"], []).append(row)
        self.frozen_splits = {split: (len(rows), 0) for split, rows in self.by_split.items()}
        self.row_system_prompts = {f"{name}/{row['id']}": row["system"] for row in self.rows if row.get("system")}

    def system_prompt_for(self, item: TaskItem) -> str:
        return self.row_system_prompts.get(item.task_id, self.system_prompt)

    def generate(self, split: str, n: int, seed: int) -> list[TaskItem]:
        """n rows of the split, in an order fixed by the seed (seed 0: the file's order)."""
        rows = list(self.by_split.get(split, []))
        if n > len(rows):
            raise ValueError(f"{self.name}: split {split!r} has {len(rows)} rows, the plan asks for {n}")
        if seed:
            random.Random(f"{self.name}/{split}/{seed}").shuffle(rows)
        return [TaskItem(family=self.name, split=split, task_id=f"{self.name}/{row['id']}", question=row["prompt"],
                         reference={"answer": row["answer"],
                                    **{key: row[key] for key in ("pattern", "metadata", "calls") if row.get(key)}})
                for row in rows[:n]]

    def demonstration_items(self, n: int, seed: int) -> list[TaskItem]:
        """n train items for a tiny policy's warm start: the train rows in a seeded order, repeated when the
        file has fewer than n (a file has no generator)."""
        rows = self.generate("train", len(self.by_split.get("train", [])), seed + 1)
        return [rows[index % len(rows)] for index in range(n)] if rows else []

    def _module(self) -> Any:
        return importlib.import_module(self.implementation) if self.implementation else None

    def initial_state(self, item: TaskItem) -> dict[str, Any]:
        module = self._module()
        if not self.tools:
            return {}
        if module is None or not hasattr(module, "initial_state"):
            return {"row": tool_row(self.rows_by_task_id[item.task_id])}
        return module.initial_state(tool_row(self.rows_by_task_id[item.task_id]))

    def call_tool(self, item: TaskItem, state: dict[str, Any], name: str, arguments: dict[str, Any]) -> str:
        if name not in {tool.name for tool in self.tools}:
            return f"error: this task has no tool {name!r}"
        return run_tool(self._module(), state, name, arguments)

    def score(self, item: TaskItem, transcript: Transcript) -> Score:
        reply = final_answer(transcript.final_text)
        ok = reply is not None and correct(self.scorer, reply, str(item.reference["answer"]), self.tolerance,
                                           item.reference.get("pattern"))
        known = {tool.name for tool in self.tools}
        used_tool = any(call.name in known and not call.result.startswith("error:") for call in transcript.tool_calls)
        success = ok and (used_tool or not self.require_tool_call)
        components = {"well_formed": float(reply is not None), "correct": float(ok)}
        if self.tools:
            components["used_tool"] = float(used_tool)
        return Score(reward=float(success), success=success, components=components,
                     outcome="success" if success else "failure")

    def _call_messages(self, item: TaskItem) -> list[dict[str, Any]]:
        """The row's reference calls as assistant tool-call and tool-result messages."""
        state, messages = self.initial_state(item), []
        for call in item.reference.get("calls", []):
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}]})
            messages.append({"role": "tool", "name": call["name"],
                             "content": self.call_tool(item, state, call["name"], call["arguments"])})
        return messages

    def demonstration(self, item: TaskItem) -> list[dict[str, Any]]:
        return self._call_messages(item) + [{"role": "assistant", "content": f"Answer: {item.reference['answer']}"}]

    def scripted_cases(self, item: TaskItem) -> list[dict[str, Any]]:
        answer = str(item.reference["answer"])
        calls = [{"tool_call": {"name": c["name"], "arguments": c["arguments"]}} for c in item.reference.get("calls", [])]
        cases = [
            {"case": "correct", "expected_success": True, "turns": [*calls, {"text": f"Answer: {answer}"}]},
            {"case": "wrong", "expected_success": False,
             "turns": [*calls, {"text": f"Answer: {wrong_answer(self.scorer, answer)}"}]},
            {"case": "no-answer-line", "expected_success": False, "turns": [*calls, {"text": answer}]},
        ]
        if self.tools:
            first = self.tools[0].name
            cases.append({"case": "malformed-call", "expected_success": False,
                          "turns": [{"raw_tool_call": '{"name": "' + first + '", "arguments": '}]})
        if self.require_tool_call:
            cases.append({"case": "no-tool", "expected_success": False, "turns": [{"text": f"Answer: {answer}"}]})
        return cases
