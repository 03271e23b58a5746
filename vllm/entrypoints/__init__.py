"""Entry points: the `vllm` command line and the servers it starts."""
