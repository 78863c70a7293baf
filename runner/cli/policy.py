"""`runner policy tiny`: the deterministic tiny CPU policy, built inside the trl stack's environment."""

from __future__ import annotations

import shutil
from pathlib import Path

import typer

from runner_contracts import TinyFamily, sha256_file

from .._engines.local import LocalEngine
from .._errors import UserError
from .._policy import WEIGHTS, build_tiny, default_plan_for_policy
from ._common import cli_errors, console, err_console, print_json

app = typer.Typer(help="Build policies for CPU qualification (no weights are ever downloaded).",
                  no_args_is_help=True)


@app.command("tiny")
def tiny(
    out: Path = typer.Option(..., "--out", help="Directory to write the policy to (must not exist or be empty)."),
    family: TinyFamily = typer.Option("qwen2", "--family", help="Model family: qwen2 (hermes tool calls), llama "
                                      "(Llama 3.1 template, llama3_json calls) or mistral ([TOOL_CALLS] calls); a "
                                      "plan names it as policy.tiny.model_family with the matching tool_format."),
    seed: int = typer.Option(0, help="Seed for tokenizer corpus, weights and SFT; same seed, same sha256."),
    sft_steps: int = typer.Option(None, help="SFT warm-start steps (default: the recipe's)."),
    rebuild: bool = typer.Option(False, "--rebuild", help="Build even if cached (e.g. to check determinism)."),
    json_output: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """Build a tiny policy of one model family: local BPE tokenizer with the family's special tokens and
    chat template, config-built weights, SFT warm start on demonstrations of the train split so it emits
    well-formed tool calls in the family's format. Cached by recipe."""
    with cli_errors():
        if out.exists() and any(out.iterdir()):
            raise UserError(f"--out {out}: directory exists and is not empty")
        recipe = ({"seed": seed} | ({"model_family": family} if family != "qwen2" else {})
                  | ({"sft_steps": sft_steps} if sft_steps is not None else {}))
        engine = LocalEngine(log=lambda message: err_console.print(f"[dim]{message}[/]"))
        with console.status("building the tiny policy in the trl environment (a few minutes on 2 cores)"):
            cached = build_tiny(engine, recipe, default_plan_for_policy(), rebuild=rebuild)
        if out.exists():
            out.rmdir()
        shutil.copytree(cached, out)
        digest = sha256_file(out / WEIGHTS)
    if json_output:
        print_json({"path": str(out), "sha256": digest, "recipe": recipe, "cache": str(cached)})
    else:
        console.print(f"tiny policy written to {out}\nsha256 {WEIGHTS}: {digest}")
