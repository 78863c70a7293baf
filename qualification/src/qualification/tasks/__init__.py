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
    replay,
    split_hash,
    strict_final_answer,
)
from .business_comm import BusinessComm
from .calc_tool import CalcTool
from .german_arith import GermanArith
from .german_rag import GermanRagCited

FAMILIES: dict[str, TaskFamily] = {
    family.name: family for family in (CalcTool(), GermanArith(), GermanRagCited(), BusinessComm())
}

# The development tracks' frozen splits (n, seed), as the shipped plans use them; hashes are computed.
FROZEN_SPLITS: dict[str, dict[str, tuple[int, int]]] = {
    "calc-tool": {"train": (64, 1), "heldout": (48, 2)},
    "german-arith": {"train": (64, 1), "retention": (48, 3)},
    "german-rag-cited": {"train": (64, 1), "heldout": (48, 2)},
    "business-comm": {"train": (64, 1), "heldout": (48, 2)},
}


def get_family(name: str) -> TaskFamily:
    """The family registered under `name`; KeyError names the known ones."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown task family {name!r}; known: {', '.join(sorted(FAMILIES))}") from None


__all__ = [
    "FAMILIES", "FROZEN_SPLITS", "SPLITS", "Score", "TaskFamily", "TaskItem", "ToolCall", "ToolParam", "ToolSpec",
    "Transcript", "exact_overlap", "get_family", "ngram_overlap", "replay", "split_hash", "strict_final_answer",
]
