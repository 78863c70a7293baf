"""runner adapter for Inspect AI."""
