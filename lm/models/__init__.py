"""The models: loading any of them (loading.py), the embedded demo models (demo.py, train.py,
corpus.py), the real pretrained pair (real.py) and its distilled draft (distill.py), built model
directories (model_dirs.py), dtypes (precision.py) and tokenizer fingerprints (fingerprint.py)."""
