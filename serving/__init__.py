"""What serving a request means, whatever door it came in by (an HTTP API, gRPC, the command line):
the generation contract between a backend and its front (:mod:`goodspeed.serving.generation`),
the asyncio helpers that keep a request's cleanup from being lost (:mod:`goodspeed.serving.aio`)
and the request metrics (:mod:`goodspeed.serving.metrics`). The verifier, the edge node and the
HTTP API (:mod:`goodspeed.api`) all build on it; it imports none of them."""
