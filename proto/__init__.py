"""The wire contract (goodspeed/v1/*.proto) and its generated stubs. Imports nothing of ours."""

# What a drafter says in Join and a verifier requires; raised when a message changes meaning
PROTOCOL_VERSION = 1
# The most rounds a DraftRequest may ask the verifier to decode by itself (its decode_ahead)
MAX_DECODE_AHEAD = 256
# The longest match a DraftRequest's decode_ahead_until_match may name
MAX_UNTIL_MATCH = 64
