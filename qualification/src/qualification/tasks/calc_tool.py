"""calc-tool: German word problems the policy must solve with a calculator tool (multi-turn)."""

from __future__ import annotations

import re
from typing import Any

from .base import Score, TaskItem, ToolParam, ToolSpec, Transcript, split_rng, strict_final_answer

_EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*$")

_TEMPLATES = {
    "+": [
        "Ein Lager hat {a} Kisten. Es kommen {b} Kisten dazu. Wie viele Kisten sind es jetzt?",
        "Anna hat {a} Euro gespart und bekommt {b} Euro geschenkt. Wie viel Geld hat sie?",
        "Im Zug sitzen {a} Personen. Am Bahnhof steigen {b} Personen ein. Wie viele sind es?",
    ],
    "-": [
        "Ein Lager hat {a} Kisten. {b} Kisten werden verkauft. Wie viele Kisten bleiben?",
        "Tom hat {a} Euro und gibt {b} Euro aus. Wie viel Geld bleibt ihm?",
        "Im Zug sitzen {a} Personen. {b} Personen steigen aus. Wie viele bleiben?",
    ],
    "*": [
        "Ein Regal hat {a} Fächer mit je {b} Büchern. Wie viele Bücher sind es?",
        "Eine Firma kauft {a} Pakete zu je {b} Euro. Wie viel kostet das?",
        "Ein Saal hat {a} Reihen mit je {b} Stühlen. Wie viele Stühle sind es?",
    ],
}


def evaluate_expression(expression: str) -> int:
    """Evaluates 'a op b' for integers and + - *; raises ValueError on anything else."""
    match = _EXPRESSION.match(expression)
    if not match:
        raise ValueError(f"kein gültiger Ausdruck: {expression!r} (erwartet: 'Zahl Operator Zahl')")
    a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def _in_heldout(a: int, b: int, op: str) -> bool:
    # A fixed partition of the item space keeps train and held-out disjoint whatever the seeds.
    return (a * 31 + b * 17 + ord(op)) % 5 == 0


class CalcTool:
    name = "calc-tool"
    scorer_version = 1
    synthetic = True
    frozen_splits = {"train": (64, 1), "heldout": (48, 2)}  # split: (n, seed) as the shipped plans use them
    system_prompt = "Nutze den Rechner. Antworte mit 'Antwort: <Zahl>'."
    tools = (
        ToolSpec(
            name="rechner",
            description="Berechnet einen Ausdruck der Form 'Zahl Operator Zahl' (+, -, *).",
            params=(ToolParam("ausdruck", "string", "Der Ausdruck, z. B. '347 + 589'."),),
        ),
    )

    def generate(self, split: str, n: int, seed: int) -> list[TaskItem]:
        rng = split_rng(self.name, split, seed)
        items: list[TaskItem] = []
        seen: set[tuple[int, str, int]] = set()
        while len(items) < n:
            op = rng.choice("+-*")
            if op == "*":
                a, b = rng.randint(3, 29), rng.randint(3, 29)
            else:
                a, b = rng.randint(100, 999), rng.randint(10, 99)
            if (a, op, b) in seen or _in_heldout(a, b, op) != (split == "heldout"):
                continue
            seen.add((a, op, b))
            question = rng.choice(_TEMPLATES[op]).format(a=a, b=b)
            expression = f"{a} {op} {b}"
            items.append(
                TaskItem(
                    family=self.name,
                    split=split,
                    task_id=f"{self.name}/{split}/{seed}/{len(items)}",
                    question=question,
                    reference={"expression": expression, "answer": evaluate_expression(expression)},
                )
            )
        return items

    def initial_state(self, item: TaskItem) -> dict[str, Any]:
        return {}

    def call_tool(self, item: TaskItem, state: dict[str, Any], name: str, arguments: dict[str, Any]) -> str:
        if name != "rechner":
            return f"Fehler: unbekanntes Werkzeug {name!r}"
        try:
            return str(evaluate_expression(str(arguments.get("ausdruck", ""))))
        except ValueError as error:
            return f"Fehler: {error}"

    def score(self, item: TaskItem, transcript: Transcript) -> Score:
        answer = strict_final_answer(transcript.final_text)
        tool_results = [call.result for call in transcript.tool_calls if call.name == "rechner"]
        expected = item.reference["answer"]
        correct = answer == expected
        # Strict: the answer must be the tool's result, so a lucky guess without the tool scores nothing.
        grounded = correct and str(expected) in tool_results
        components = {
            "tool_called": float(bool(tool_results)),
            "well_formed": float(answer is not None),
            "correct": float(correct),
            "grounded": float(grounded),
        }
        return Score(reward=float(grounded), success=grounded, components=components,
                     outcome="success" if grounded else "failure")

    def demonstration(self, item: TaskItem) -> list[dict[str, Any]]:
        expression = item.reference["expression"]
        answer = item.reference["answer"]
        return [
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "rechner", "arguments": {"ausdruck": expression}}}]},
            {"role": "tool", "name": "rechner", "content": str(answer)},
            {"role": "assistant", "content": f"Antwort: {answer}"},
        ]

    def scripted_cases(self, item: TaskItem) -> list[dict[str, Any]]:
        """Known-good and known-bad episodes for the service gate, as neutral assistant turns."""
        expression, answer = item.reference["expression"], item.reference["answer"]
        call = {"tool_call": {"name": "rechner", "arguments": {"ausdruck": expression}}}
        a, op, b = expression.split()
        wrong_call = {"tool_call": {"name": "rechner", "arguments": {"ausdruck": f"{a} {op} {int(b) + 1}"}}}
        return [
            {"case": "correct", "expected_success": True, "turns": [call, {"text": f"Antwort: {answer}"}]},
            {"case": "wrong-answer", "expected_success": False, "turns": [call, {"text": f"Antwort: {answer + 1}"}]},
            {"case": "no-tool", "expected_success": False, "turns": [{"text": f"Antwort: {answer}"}]},
            {"case": "wrong-expression", "expected_success": False,
             "turns": [wrong_call, {"text": f"Antwort: {evaluate_expression(f'{a} {op} {int(b) + 1}')}"}]},
            {"case": "malformed-call", "expected_success": False,
             "turns": [{"raw_tool_call": '{"name": "rechner", "arguments": {"ausdruck": '}]},
            {"case": "no-answer-line", "expected_success": False,
             "turns": [call, {"text": f"Das Ergebnis ist {answer}."}]},
        ]
