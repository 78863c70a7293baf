"""The calculator, a taskset-scoped MCP toolset (one server per env, started by verifiers as
`python -m rechner_vf.tools`)."""

from __future__ import annotations

import operator
import re
from typing import Annotated

import verifiers.v1 as vf
from pydantic import Field

OPERATORS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
EXPRESSION = re.compile(r"^\s*(-?\d+)\s*([+*-])\s*(-?\d+)\s*$")


class RechnerToolsetConfig(vf.SharedToolsetConfig):
    pass


class RechnerToolset(vf.Toolset[RechnerToolsetConfig, vf.State]):
    TOOL_PREFIX = None  # the model sees `rechner`, not `rechner_toolset_rechner`

    @vf.tool
    def rechner(self, ausdruck: Annotated[str, Field(description="Der Ausdruck, z. B. '347 + 589'.")]) -> str:
        """Berechnet einen Ausdruck der Form 'Zahl Operator Zahl' (+, -, *)."""
        match = EXPRESSION.match(ausdruck)
        if not match:
            raise ValueError(f"kein Ausdruck der Form 'Zahl Operator Zahl': {ausdruck!r}")
        left, symbol, right = match.groups()
        return str(OPERATORS[symbol](int(left), int(right)))


if __name__ == "__main__":
    RechnerToolset.run()
