"""The draft node: a small model that drafts with its own KV cache and applies verdicts."""
