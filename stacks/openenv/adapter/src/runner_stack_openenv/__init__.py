"""runner adapter for OpenEnv 0.10.0: our task families as an OpenEnv Environment, episodes through EnvClient."""
