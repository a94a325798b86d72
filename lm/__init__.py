"""The shared LM layer: model loading, logits processing, tokenizer fingerprints, demo models."""
