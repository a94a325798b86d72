"""What decoding means, the same on both sides: a request's sampling settings (params.py) and
their logits processing (sampling.py), the logit adjustments a request asks for (adjust.py, over
the text it reads: history.py), structured output (structured.py), seeded random streams
(seeding.py), what a draft proposes (proposals.py) and the draft sources (draft_source.py,
lookup.py). params, history, structured, seeding, proposals, draft_source and lookup import no
torch: an edge node drafting by lookup alone runs on them."""
