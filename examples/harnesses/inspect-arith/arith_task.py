"""An Inspect task written for this repository (no download): 16 German arithmetic word problems in the
style of the german-arith family, answered as 'Antwort: <Zahl>' and scored by Inspect's pattern scorer.
Run by a plan's harnesses (examples/harnesses/plan.yaml), or by hand: `inspect eval arith_task.py`."""

from pathlib import Path

from inspect_ai import Task, task
from inspect_ai.dataset import json_dataset
from inspect_ai.scorer import pattern
from inspect_ai.solver import generate, system_message


@task
def rechnen():
    return Task(
        dataset=json_dataset(str(Path(__file__).with_name("rechnen.jsonl"))),
        solver=[system_message("Rechne im Kopf. Antworte mit 'Antwort: <Zahl>'."), generate()],
        scorer=pattern(r"Antwort:\s*(-?\d+)"),
    )
