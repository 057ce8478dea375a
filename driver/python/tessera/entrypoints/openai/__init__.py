"""The OpenAI-compatible server (`tessera serve`)."""
