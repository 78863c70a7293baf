"""runner: qualify RL / fine-tuning stacks on one frozen plan, each in its own pinned environment.

The host never imports a stack's upstream packages; it runs adapters through engines and audits the
files they write. Public surface: the `runner` CLI and `runner.api`.
"""

__version__ = "0.1.0"
