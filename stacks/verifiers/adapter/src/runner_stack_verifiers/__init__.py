"""runner adapter for Verifiers 0.4.0. Also the taskset plugin verifiers loads by id
(`taskset.id = "runner_stack_verifiers"`): it exports exactly one vf.Taskset through `__all__`,
imported lazily so the adapter entry point does not import verifiers for the probe."""

__all__ = ["QualTaskset"]


def __getattr__(name: str):
    if name == "QualTaskset":
        from .taskset import QualTaskset

        return QualTaskset
    raise AttributeError(name)
