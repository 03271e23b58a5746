"""Worker processes (`worker.py`) and the model runner (`gpu/`), one per rank."""
