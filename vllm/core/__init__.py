"""Engine-core scheduling state: requests, the block pool with prefix caching, the KV cache
manager and the scheduler. Runs in the engine-core process; knows nothing about devices."""
