"""Parallel groups and the plumbing that splits work across ranks (PCP token sharding, DCP KV
ownership, EP dispatch). Model code receives group objects from here, never raw ranks."""
