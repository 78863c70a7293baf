"""`runner tasks`: the task families every arm shares (this project's and any installed package's, found
through the runner.task_families entry point group), their frozen splits, sample items, and a check of a
family against its own scorer and tools."""

from __future__ import annotations

import json

import typer
from rich.markup import escape
from rich.table import Table

from qualification.tasks import FamilyError, TaskFamily, check_family, get_family, source_of, sources, split_hash

from pathlib import Path

from .._errors import UserError
from .._plan import load_plan
from ._common import cli_errors, console, err_console, print_json

app = typer.Typer(help="Task families (generators, tools, reference scorers) shared by every stack.",
                  no_args_is_help=True)


PLAN_OPTION = typer.Option(None, "--plan", help="Also the families of this plan's task packages (task.packages).")


def _with_plan(plan_path: Path | None) -> None:
    if plan_path is not None:
        load_plan(plan_path, lambda message: err_console.print(f"[dim]{message}[/]"))


def _family(name: str) -> TaskFamily:
    try:
        return get_family(name)
    except FamilyError as error:
        raise UserError(str(error)) from None


@app.command("list")
def list_tasks(plan_path: Path = PLAN_OPTION,
               json_output: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Families with where they come from (distribution and version), their frozen splits (size, seed,
    content sha256), tools and scorer version. A package adds families under the runner.task_families
    entry point group; install it into the host and list it here."""
    rows = []
    with cli_errors():
        _with_plan(plan_path)
        for name, source in sources().items():
            family = _family(name)
            splits = {split: {"n": n, "seed": seed, "sha256": split_hash(family.generate(split, n, seed))}
                      for split, (n, seed) in family.frozen_splits.items()}
            rows.append({"family": name, "source": source.reference, "distribution": source.distribution,
                         "version": source.version, "synthetic": family.synthetic,
                         "scorer_version": family.scorer_version, "tools": [tool.name for tool in family.tools],
                         "splits": splits})
    if json_output:
        print_json(rows)
        return
    table = Table(title="task families")
    for column in ("family", "from", "scorer", "tools", "split", "n", "seed", "sha256"):
        table.add_column(column)
    for row in rows:
        for index, (split, info) in enumerate(row["splits"].items() or [("-", {"n": "-", "seed": "-", "sha256": "-"})]):
            first = index == 0
            origin = f"{row['distribution']} {row['version']}" + ("" if row["synthetic"] else " (real data)")
            table.add_row(row["family"] if first else "", origin if first else "",
                          f"v{row['scorer_version']}" if first else "", ", ".join(row["tools"]) or "-" if first else "",
                          split, str(info["n"]), str(info["seed"]), info["sha256"][:16])
    console.print(table)


@app.command("check")
def check(
    family_name: str = typer.Argument(..., metavar="FAMILY", help="A family from `runner tasks list`."),
    n: int = typer.Option(8, "-n", help="Items per split to check."),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated items."),
    plan_path: Path = PLAN_OPTION,
    json_output: bool = typer.Option(False, "--json", help="Print the findings as JSON."),
) -> None:
    """Check a family before spending a run on it: deterministic generator, unique ids, disjoint train and
    held-out, every demonstration succeeds under the family's own tools and scorer, every scripted case
    (known-good and known-bad) scores as labelled, rewards in [0, 1]. Exit code 0 when nothing is found,
    1 otherwise."""
    with cli_errors():
        _with_plan(plan_path)
        family = _family(family_name)
        source = source_of(family_name)
        problems, counts = check_family(family, n=n, seed=seed)
    if json_output:
        print_json({"family": family_name, "source": source.reference, "version": source.version,
                    "problems": problems, "checked": counts})
    else:
        checked = (f"{counts['items']} items, {counts['demonstrations']} demonstrations, {counts['cases']} "
                   f"scripted cases")
        if problems:
            for problem in problems:
                err_console.print(f"[red]problem:[/] {problem}", highlight=False)
            console.print(f"[red]{family_name} ({source.describe()}): {len(problems)} problem(s)[/] in {checked}",
                          highlight=False)
        else:
            console.print(f"[green]{family_name} ({source.describe()}): no problem[/] in {checked}", highlight=False)
    raise typer.Exit(1 if problems else 0)


@app.command("show")
def show(
    family_name: str = typer.Argument(..., metavar="FAMILY", help="e.g. german-rag-cited"),
    split: str = typer.Option("train", "--split", help="train, heldout or retention."),
    n: int = typer.Option(3, "-n", help="How many items."),
    seed: int = typer.Option(None, "--seed", help="Default: the frozen split's seed."),
    plan_path: Path = PLAN_OPTION,
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Print sample items of a split: question, reference and the demonstration a policy should follow."""
    with cli_errors():
        _with_plan(plan_path)
        family = _family(family_name)
        seed = seed if seed is not None else family.frozen_splits.get(split, (0, 0))[1]
        items = family.generate(split, n, seed)
    if json_output:
        print_json([{"task_id": i.task_id, "question": i.question, "reference": i.reference,
                     "demonstration": family.demonstration(i)} for i in items])
        return
    kind = "synthetic" if family.synthetic else "real data"
    console.print(f"[bold]{family.name}[/] ({kind}, scorer v{family.scorer_version}) system prompt: "
                  f"{family.system_prompt}", highlight=False)
    for item in items:
        console.print(f"\n[bold]{item.task_id}[/]\n{item.question}", highlight=False)
        console.print(f"[dim]reference:[/] {json.dumps(item.reference, ensure_ascii=False)[:400]}", highlight=False)
        for message in family.demonstration(item):
            calls = message.get("tool_calls")
            text = (json.dumps([c["function"] for c in calls], ensure_ascii=False) if calls
                    else message.get("content", ""))
            console.print(f"  [cyan]{message['role']}[/]: {text}", highlight=False, markup=True)


@app.command("lock")
def lock(
    package: Path = typer.Argument(None, metavar="[DIR]", help="A task package's folder (its pyproject.toml)."),
    requirement: str = typer.Option(None, "--requirement", help="Instead of DIR: a task package on the package "
                                                               "index, pinned as name==version."),
    out: Path = typer.Option(None, "--out", help="With --requirement: the lock file to write."),
) -> None:
    """Pin a task package's dependencies with sha256 hashes, resolved by pip on this Python (wheels only,
    pure Python). With DIR: pyproject.toml's [project] dependencies into DIR/requirements.lock. With
    --requirement: the package from the index pip is configured with (PIP_INDEX_URL, PIP_FIND_LINKS) and
    everything it needs into --out; a plan then names it as {requirement: ..., lock: FILE}. Runs install
    the lock in hash-checking mode into the plan's task-package folder."""
    from .._task_packages import lock_requirements, write_lock

    log = lambda message: err_console.print(f"[dim]{escape(message)}[/]")  # noqa: E731
    with cli_errors():
        if (package is None) == (requirement is None):
            raise UserError("give a task package's folder (DIR) or --requirement NAME==VERSION with --out")
        if requirement is not None and out is None:
            raise UserError("--requirement needs --out: the lock file to write")
        with err_console.status("resolving with pip"):
            target = (write_lock(package, log) if package is not None else
                      lock_requirements([requirement], out, f"the task package {requirement}", log))
    pins = [line for line in target.read_text().splitlines() if line and not line.startswith("#")]
    console.print(f"{target}: {len(pins)} pins with sha256 hashes", highlight=False)


@app.command("from-dataset")
def from_dataset(
    dataset: Path = typer.Argument(..., metavar="FILE", help="A .jsonl, .csv or .parquet file, one row per prompt."),
    name: str = typer.Option(..., "--name", help="The family's name, e.g. support-faq."),
    scorer: str = typer.Option(..., "--scorer", help="exact, numeric (--tolerance), choice (option letter), regex "
                                                     "(the row's pattern column) or math (equivalence by math-verify)."),
    out: Path = typer.Option(..., "--out", help="Folder to write the task package into."),
    id_column: str = typer.Option("id", "--id-column"),
    prompt_column: str = typer.Option("prompt", "--prompt-column"),
    answer_column: str = typer.Option("answer", "--answer-column"),
    split_column: str = typer.Option("split", "--split-column", help="train / heldout / retention per row; rows "
                                                                     "without one are split by a hash of the prompt."),
    pattern_column: str = typer.Option("pattern", "--pattern-column", help="Scorer regex: accepted replies."),
    system_column: str = typer.Option("system", "--system-column", help="Optional: the row's own system prompt."),
    metadata_columns: str = typer.Option("", "--metadata-columns", help="Comma-separated columns kept with each "
                                                                       "row (in its reference's metadata)."),
    heldout_share: float = typer.Option(0.25, "--heldout-share", help="Share of hash-split rows held out."),
    tolerance: float = typer.Option(1e-6, "--tolerance", help="Scorer numeric: absolute tolerance."),
    system_prompt: str = typer.Option("Answer on the last line as 'Answer: <answer>'.", "--system-prompt",
                                      help="For rows without their own."),
    tools_file: Path = typer.Option(None, "--tools", help="A tool-using dataset's sidecar (YAML): module (a .py "
                                                          "file beside it), tools (name, description, parameters), "
                                                          "require_tool_call. Rows give the calls of a correct "
                                                          "episode in their calls column (--calls-column)."),
    calls_column: str = typer.Option("calls", "--calls-column"),
) -> None:
    """Turn a dataset file into a task package: every row checked (a missing answer, a duplicate id, an
    empty prompt, a prompt in both train and held-out are refused, naming file, line and column), the rows
    and a family written to --out. Name the folder in a plan's task.packages to qualify on it."""
    from .._datasets import Columns, read_dataset, read_tools, write_package

    with cli_errors():
        tools = read_tools(tools_file) if tools_file is not None else None
        rows = read_dataset(dataset, scorer, Columns(id=id_column, prompt=prompt_column, answer=answer_column,
                                                     split=split_column, pattern=pattern_column, system=system_column,
                                                     metadata=tuple(c.strip() for c in metadata_columns.split(",")
                                                                    if c.strip()), calls=calls_column),
                            heldout_share, tools)
        write_package(out, name, rows, scorer, tolerance=tolerance, system_prompt=system_prompt, tools=tools)
    counts = {split: sum(1 for row in rows if row["split"] == split) for split in ("train", "heldout", "retention")}
    console.print(f"{name}: {len(rows)} rows ({', '.join(f'{k} {v}' for k, v in counts.items() if v)}) in {out}\n"
                  f"in a plan:\n  task:\n    family: {name}\n    packages: [{out}]\n"
                  f"    train: {{split: train, n: {counts['train']}, seed: 1}}\n"
                  f"    heldout: {{split: heldout, n: {counts['heldout']}, seed: 2}}\n"
                  f"  reward: {{scorer: {name}, version: 1}}", highlight=False, markup=False)
