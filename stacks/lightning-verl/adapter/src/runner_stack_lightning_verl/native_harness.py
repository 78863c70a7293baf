"""Runs a team's own harness, `module:function`, as one rollout's program: the harness knows only the
OpenAI-compatible endpoint in its environment (OPENAI_BASE_URL, OPENAI_API_KEY, and OPENAI_MODEL for the
model name), as any OpenAI-SDK program does, and is called unmodified with its task, the dataset row.
It returns its own reward: a number, or a dict with `reward` (and optionally `final_text`).

    echo '{"harness": "module:function", "row": {...}}' | OPENAI_BASE_URL=... python native_harness.py

Prints one JSON line: {"reward", "final_text"}.
"""

from __future__ import annotations

import importlib
import json
import math
import sys


def main() -> None:
    task = json.loads(sys.stdin.read())
    module_name, _, attribute = task["harness"].partition(":")
    harness = getattr(importlib.import_module(module_name), attribute)
    returned = harness(task["row"])
    reward, final_text = (returned.get("reward"), returned.get("final_text", "")) if isinstance(returned, dict) \
        else (returned, "")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise SystemExit(f"the harness {task['harness']} returned {returned!r}: expected its reward, a finite "
                         "number (or a dict with reward)")
    sys.stdout.write(json.dumps({"reward": float(reward), "final_text": str(final_text or "")}) + "\n")


if __name__ == "__main__":
    main()
