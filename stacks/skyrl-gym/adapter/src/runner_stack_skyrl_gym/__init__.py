"""runner adapter for SkyRL Gym."""
