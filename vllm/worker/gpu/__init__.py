"""Model Runner V2: persistent per-request state on the device (`states.py`), per-step inputs
built with tensor ops (`input_batch.py`), device sampling (`sampler.py`), and the runner that ties
them to the model (`model_runner.py`). "gpu" is upstream's name; the same code runs on CPU."""
