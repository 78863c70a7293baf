"""Task families: deterministic generators, tools and reference scorers shared by every arm. Families are
found through the `runner.task_families` entry point group (registry.py), so a team's own package adds
families without editing this one."""

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
    opening_messages,
    replay,
    split_hash,
    strict_final_answer,
)
from .check import check_family, play_scripted_case, service_cases
from .native import NativeFamily, use_plan
from .registry import GROUP, FamilyError, FamilySource, families, get_family, source_of, sources

__all__ = [
    "GROUP", "SPLITS", "FamilyError", "FamilySource", "NativeFamily", "Score", "TaskFamily", "TaskItem", "ToolCall",
    "ToolParam", "ToolSpec", "Transcript", "check_family", "exact_overlap", "families", "get_family",
    "ngram_overlap", "opening_messages", "play_scripted_case", "replay", "source_of", "sources", "split_hash", "strict_final_answer", "use_plan", "service_cases",
]
