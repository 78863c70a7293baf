"""A word-problem agent written against the OpenAI SDK only."""
