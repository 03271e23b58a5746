"""The OpenAI-compatible HTTP server (`vllm serve`)."""
