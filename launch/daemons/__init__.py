"""The daemons' entry points: the verifier (serve.py: its engine, server and local serving
composed from one spec) and the edge draft node (draft_node.py: serving the API, or drafting a
prompt file)."""
