"""The wire contract (goodspeed/v1/*.proto) and its generated stubs. Imports nothing of ours."""
