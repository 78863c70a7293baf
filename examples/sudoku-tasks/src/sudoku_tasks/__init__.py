"""sudoku-cell: a task family around py-sudoku (a procedural Sudoku generator and validator on PyPI)."""
