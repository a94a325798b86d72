"""The verifier: batched lossless verification of many drafters against one target."""
