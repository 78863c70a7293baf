"""runner adapter for lm-evaluation-harness."""
