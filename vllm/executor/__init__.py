"""Executors: how the engine core reaches its workers. One process per rank, always."""
