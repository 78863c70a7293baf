"""runner adapter for Agent Lightning 1.0.2: an unmodified team harness behind agl-server's gateway."""
