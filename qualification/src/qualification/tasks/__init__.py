"""Task families: deterministic generators, tools and reference scorers shared by every arm."""

from __future__ import annotations

from .base import (
    SPLITS,
    Score,
    TaskFamily,
    TaskItem,
    ToolCall,
    ToolParam,
    ToolSpec,
    Transcript,
    exact_overlap,
    ngram_overlap,
    split_hash,
    strict_final_answer,
)
from .calc_tool import CalcTool
from .german_arith import GermanArith

FAMILIES: dict[str, TaskFamily] = {family.name: family for family in (CalcTool(), GermanArith())}


def get_family(name: str) -> TaskFamily:
    """The family registered under `name`; KeyError names the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown task family {name!r}; known: {', '.join(sorted(FAMILIES))}") from None


__all__ = [
    "FAMILIES", "SPLITS", "Score", "TaskFamily", "TaskItem", "ToolCall", "ToolParam", "ToolSpec",
    "Transcript", "exact_overlap", "get_family", "ngram_overlap", "split_hash", "strict_final_answer",
]
