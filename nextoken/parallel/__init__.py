"""Tensor parallelism: a model's heads and feed-forward columns split across processes (`shard.py`), the process
group that joins them (`group.py`) and the worker loop of ranks above 0 (`worker.py`)."""
