"""Entry points kept under vLLM's module names."""
