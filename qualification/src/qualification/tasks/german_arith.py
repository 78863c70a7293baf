"""german-arith: German arithmetic word problems with a strict final-answer protocol, no tools."""

from __future__ import annotations

from typing import Any

from .base import Score, TaskItem, ToolSpec, Transcript, split_rng, strict_final_answer

_TEMPLATES = [
    ("+", "Lisa hat {a} Äpfel und bekommt {b} dazu. Wie viele Äpfel hat sie?"),
    ("+", "Auf dem Tisch liegen {a} Stifte. Jan legt {b} dazu. Wie viele Stifte sind es?"),
    ("-", "Max hat {a} Murmeln und verliert {b}. Wie viele Murmeln hat er noch?"),
    ("-", "Im Korb sind {a} Eier. {b} Eier gehen kaputt. Wie viele bleiben?"),
]


class GermanArith:
    """Grade-school arithmetic in the style of MGSM (synthetic); the default retention probe."""

    name = "german-arith"
    scorer_version = 1
    synthetic = True
    frozen_splits = {"train": (64, 1), "retention": (48, 3)}  # split: (n, seed) as the shipped plans use them
    system_prompt = "Rechne im Kopf. Antworte mit 'Antwort: <Zahl>'."
    tools: tuple[ToolSpec, ...] = ()

    def generate(self, split: str, n: int, seed: int) -> list[TaskItem]:
        rng = split_rng(self.name, split, seed)
        items: list[TaskItem] = []
        for index in range(n):
            op, template = rng.choice(_TEMPLATES)
            a = rng.randint(2, 9)
            b = rng.randint(1, a - 1) if op == "-" else rng.randint(1, 9)
            answer = a + b if op == "+" else a - b
            items.append(
                TaskItem(
                    family=self.name,
                    split=split,
                    task_id=f"{self.name}/{split}/{seed}/{index}",
                    question=template.format(a=a, b=b),
                    reference={"answer": answer},
                )
            )
        return items

    def initial_state(self, item: TaskItem) -> dict[str, Any]:
        return {}

    def call_tool(self, item: TaskItem, state: dict[str, Any], name: str, arguments: dict[str, Any]) -> str:
        return f"Fehler: diese Aufgabe hat kein Werkzeug {name!r}"

    def score(self, item: TaskItem, transcript: Transcript) -> Score:
        answer = strict_final_answer(transcript.final_text)
        correct = answer == item.reference["answer"]
        components = {"well_formed": float(answer is not None), "correct": float(correct)}
        return Score(reward=float(correct), success=correct, components=components,
                     outcome="success" if correct else "failure")

    def demonstration(self, item: TaskItem) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": f"Antwort: {item.reference['answer']}"}]

    def scripted_cases(self, item: TaskItem) -> list[dict[str, Any]]:
        answer = item.reference["answer"]
        return [
            {"case": "correct", "expected_success": True, "turns": [{"text": f"Antwort: {answer}"}]},
            {"case": "wrong-answer", "expected_success": False, "turns": [{"text": f"Antwort: {answer + 1}"}]},
            {"case": "not-strict", "expected_success": False, "turns": [{"text": f"Die Antwort ist {answer}."}]},
        ]
