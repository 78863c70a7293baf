"""runner adapter for NeMo Gym 0.7.0: a resources server per task family, the stock simple_agent, and a
vllm_model subclass that names the episode on every policy call."""
