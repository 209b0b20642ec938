"""matrix: a test-matrix runner for disaggregated LLM serving."""

__version__ = "0.1.0"
