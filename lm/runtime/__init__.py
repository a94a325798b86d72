"""Running a model fast: the slot KV cache (kv_slots.py) and packed forwards over it (packing.py,
attention.py), steps at fixed shapes replayed as CUDA graphs or compiled (graphs.py), batched
drafting (batch_draft.py), the text's prefix hash (prefix.py) and handing freed heap back (heap.py)."""
