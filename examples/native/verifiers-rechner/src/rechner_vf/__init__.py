"""Word problems with a calculator, as a Verifiers taskset (`--env.taskset.id rechner_vf`)."""

from rechner_vf.taskset import RechnerConfig, RechnerData, RechnerTask, RechnerTaskset

__all__ = ["RechnerConfig", "RechnerData", "RechnerTask", "RechnerTaskset"]
