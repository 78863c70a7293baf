"""The `runner` command line: one module per command, registered here."""

from __future__ import annotations

import signal

import typer

from . import bundle, compare, images, pin, plan, policy, qualify, report, stacks, status, tasks, validate

app = typer.Typer(
    name="runner",
    help="Qualify RL and fine-tuning stacks before committing GPU weeks to one.\n\n"
         "Each stack runs in its own pinned environment on one frozen plan; runner audits the evidence "
         "(sampled tokens, loss masks, logprobs, resume after a kill) and reports gates and statistics.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.add_typer(stacks.app, name="stacks")
app.add_typer(policy.app, name="policy")
app.add_typer(tasks.app, name="tasks")
app.add_typer(images.app, name="images")
app.add_typer(plan.app, name="plan")
app.add_typer(bundle.app, name="bundle")
app.command("qualify")(qualify.qualify)
app.command("compare")(compare.compare)
app.command("pin")(pin.pin)
app.command("validate")(validate.validate)
app.command("report")(report.report)
app.command("status")(status.status)
app.command("cancel")(status.cancel)


def _terminate(signum, frame) -> None:
    # SIGTERM unwinds like Ctrl-C, so running stages are killed and their evidence marked.
    raise SystemExit(128 + signum)


def main() -> None:
    signal.signal(signal.SIGTERM, _terminate)
    app()
