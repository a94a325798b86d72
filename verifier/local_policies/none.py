"""``none``: plain decoding, the baseline every policy is measured against."""

from __future__ import annotations

from goodspeed.verifier.local_policies.base import LocalPolicy, Plan


class PlainDecoding(LocalPolicy):
    """No draft; the target decodes one token per request per iteration."""

    name = "none"

    def plan(self, reqs):
        return {r.request_id: Plan([]) for r in reqs}, 0
