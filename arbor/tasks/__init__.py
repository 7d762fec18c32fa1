"""Built-in tasks: data generators, environments, verifiers."""
