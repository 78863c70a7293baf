"""`runner tasks`: the task families every arm shares, their frozen splits and sample items."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from qualification.tasks import FAMILIES, FROZEN_SPLITS, get_family, split_hash

from .._errors import UserError
from ._common import cli_errors, console, print_json

app = typer.Typer(help="Task families (generators, tools, reference scorers) shared by every stack.",
                  no_args_is_help=True)


@app.command("list")
def list_tasks(json_output: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Families with their frozen splits (size, seed, content sha256), tools and scorer version."""
    rows = []
    for name, family in FAMILIES.items():
        splits = {split: {"n": n, "seed": seed, "sha256": split_hash(family.generate(split, n, seed))}
                  for split, (n, seed) in FROZEN_SPLITS.get(name, {}).items()}
        rows.append({"family": name, "synthetic": family.synthetic, "scorer_version": family.scorer_version,
                     "tools": [tool.name for tool in family.tools], "splits": splits})
    if json_output:
        print_json(rows)
        return
    table = Table(title="task families (all synthetic development tracks)")
    for column in ("family", "scorer", "tools", "split", "n", "seed", "sha256"):
        table.add_column(column)
    for row in rows:
        for index, (split, info) in enumerate(row["splits"].items()):
            first = index == 0
            table.add_row(row["family"] if first else "", f"v{row['scorer_version']}" if first else "",
                          ", ".join(row["tools"]) or "-" if first else "", split, str(info["n"]), str(info["seed"]),
                          info["sha256"][:16])
    console.print(table)


@app.command("show")
def show(
    family_name: str = typer.Argument(..., metavar="FAMILY", help="e.g. german-rag-cited"),
    split: str = typer.Option("train", "--split", help="train, heldout or retention."),
    n: int = typer.Option(3, "-n", help="How many items."),
    seed: int = typer.Option(None, "--seed", help="Default: the frozen split's seed."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Print sample items of a split: question, reference and the demonstration a policy should follow."""
    with cli_errors():
        try:
            family = get_family(family_name)
        except KeyError as error:
            raise UserError(str(error.args[0])) from None
        seed = seed if seed is not None else FROZEN_SPLITS.get(family_name, {}).get(split, (0, 0))[1]
        items = family.generate(split, n, seed)
    if json_output:
        print_json([{"task_id": i.task_id, "question": i.question, "reference": i.reference,
                     "demonstration": family.demonstration(i)} for i in items])
        return
    console.print(f"[bold]{family.name}[/] (synthetic, scorer v{family.scorer_version}) system prompt: "
                  f"{family.system_prompt}", highlight=False)
    for item in items:
        console.print(f"\n[bold]{item.task_id}[/]\n{item.question}", highlight=False)
        console.print(f"[dim]reference:[/] {json.dumps(item.reference, ensure_ascii=False)[:400]}", highlight=False)
        for message in family.demonstration(item):
            calls = message.get("tool_calls")
            text = (json.dumps([c["function"] for c in calls], ensure_ascii=False) if calls
                    else message.get("content", ""))
            console.print(f"  [cyan]{message['role']}[/]: {text}", highlight=False, markup=True)
