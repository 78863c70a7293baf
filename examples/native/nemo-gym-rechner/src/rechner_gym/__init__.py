"""A calculator resources server for NeMo Gym."""
