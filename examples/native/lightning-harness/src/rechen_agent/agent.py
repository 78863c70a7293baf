"""solve(task) -> reward: asks the model, checks 'Antwort: <Zahl>' against the task's answer, and gives the
model one more try with feedback when the first answer is wrong or missing.

The agent knows only what any OpenAI-SDK program knows: OPENAI_BASE_URL and OPENAI_API_KEY (read by the
client), and OPENAI_MODEL for the model's name.
"""

from __future__ import annotations

import os
import re

from openai import OpenAI

SYSTEM = "Rechne im Kopf. Antworte mit 'Antwort: <Zahl>'."
ANSWER = re.compile(r"Antwort:\s*(-?\d+)")


def _answer(text: str) -> int | None:
    match = ANSWER.search(text or "")
    return int(match.group(1)) if match else None


def solve(task: dict) -> dict:
    client = OpenAI(max_retries=0)
    model = os.environ.get("OPENAI_MODEL", "default")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["question"]}]
    text = ""
    for _ in range(2):
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=48)
        text = reply.choices[0].message.content or ""
        if _answer(text) == task["answer"]:
            return {"reward": 1.0, "final_text": text}
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": "Das stimmt nicht. Versuche es noch einmal."}]
    return {"reward": 0.0, "final_text": text}
