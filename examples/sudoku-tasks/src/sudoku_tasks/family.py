"""sudoku-cell: one empty cell of a solved 4x4 Sudoku; the policy answers with the digit that goes there.

The puzzles come from py-sudoku's own generator and the answers are judged by its own validator: the
reply's digit is written into the cell and the library says whether the board is a valid, complete
Sudoku. The library seeds Python's global random module, so every call here restores that state after
it (a family must not change the random state of the stack process it runs in)."""

from __future__ import annotations

import hashlib
import random
import re
from contextlib import contextmanager
from typing import Any

from sudoku import Sudoku

from qualification.tasks import Score, TaskItem, Transcript

ANSWER = re.compile(r"^Answer:\s*(\d)\s*$")
BOX = 2  # 2x2 boxes: a 4x4 grid of the digits 1 to 4


@contextmanager
def _own_random_state():
    state = random.getstate()
    try:
        yield
    finally:
        random.setstate(state)


def solved_board(seed: int) -> list[list[int]]:
    with _own_random_state():
        return Sudoku(BOX, seed=seed).solve().board


def valid_and_complete(board: list[list[int | None]]) -> bool:
    """py-sudoku's own verdict on a filled board. Its validate() checks for repeated digits only (a 7 in a
    4x4 board passes), so the range is checked here first: `runner tasks check` found that."""
    if any(cell not in range(1, BOX * BOX + 1) for row in board for cell in row):
        return False
    with _own_random_state():
        return bool(Sudoku(BOX, BOX, board=[row[:] for row in board]).validate())


def _grid(board: list[list[int | None]]) -> str:
    return "\n".join(" ".join("." if cell is None else str(cell) for cell in row) for row in board)


def _answer(text: str) -> int | None:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    match = ANSWER.match(lines[-1]) if lines else None
    return int(match.group(1)) if match else None


def _heldout(board: list[list[int]], row: int, column: int) -> bool:
    # A fixed partition of the item space: a held-out (board, cell) never occurs in train, whatever the seeds.
    return hashlib.sha256(f"{board}/{row}/{column}".encode()).digest()[0] % 5 == 0


class SudokuCell:
    name = "sudoku-cell"
    scorer_version = 1
    synthetic = True
    frozen_splits = {"train": (64, 1), "heldout": (48, 2)}
    system_prompt = "Fill the empty cell (.) of the 4x4 Sudoku. Answer with 'Answer: <digit>'."
    tools = ()

    def generate(self, split: str, n: int, seed: int) -> list[TaskItem]:
        rng = random.Random(f"{self.name}/{split}/{seed}")
        items: list[TaskItem] = []
        seen: set[str] = set()
        while len(items) < n:
            board = solved_board(rng.randrange(2**31))
            row, column = rng.randrange(BOX * BOX), rng.randrange(BOX * BOX)
            key = f"{board}/{row}/{column}"
            if key in seen or _heldout(board, row, column) != (split == "heldout"):
                continue
            seen.add(key)
            puzzle = [r[:] for r in board]
            puzzle[row][column] = None
            items.append(TaskItem(family=self.name, split=split, task_id=f"{self.name}/{split}/{seed}/{len(items)}",
                                  question=f"{_grid(puzzle)}\nWhich digit goes in the empty cell?",
                                  reference={"puzzle": puzzle, "row": row, "column": column,
                                             "digit": board[row][column]}))
        return items

    def initial_state(self, item: TaskItem) -> dict[str, Any]:
        return {}

    def call_tool(self, item: TaskItem, state: dict[str, Any], name: str, arguments: dict[str, Any]) -> str:
        return f"error: this task has no tool {name!r}"

    def score(self, item: TaskItem, transcript: Transcript) -> Score:
        digit = _answer(transcript.final_text)
        ok = False
        if digit is not None:
            board = [row[:] for row in item.reference["puzzle"]]
            board[item.reference["row"]][item.reference["column"]] = digit
            ok = valid_and_complete(board)
        return Score(reward=float(ok), success=ok, components={"well_formed": float(digit is not None),
                                                               "valid": float(ok)},
                     outcome="success" if ok else "failure")

    def demonstration(self, item: TaskItem) -> list[dict[str, Any]]:
        return [{"role": "assistant", "content": f"Answer: {item.reference['digit']}"}]

    def scripted_cases(self, item: TaskItem) -> list[dict[str, Any]]:
        digit = item.reference["digit"]
        wrong = digit % (BOX * BOX) + 1  # another digit of the row: the board becomes invalid
        return [
            {"case": "correct", "expected_success": True, "turns": [{"text": f"Answer: {digit}"}]},
            {"case": "wrong-digit", "expected_success": False, "turns": [{"text": f"Answer: {wrong}"}]},
            {"case": "out-of-range", "expected_success": False, "turns": [{"text": "Answer: 7"}]},
            {"case": "no-answer-line", "expected_success": False, "turns": [{"text": str(digit)}]},
        ]
