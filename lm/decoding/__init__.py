"""What decoding means, the same on both sides: sampling settings and logits processing
(sampling.py), the logit adjustments a request asks for (adjust.py), structured output
(structured.py), seeded random streams (seeding.py), and the draft sources (draft_source.py,
lookup.py)."""
