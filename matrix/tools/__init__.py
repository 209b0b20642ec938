"""Stand-alone scripts that run inside a runtime's environment (they import only that runtime's packages)."""
