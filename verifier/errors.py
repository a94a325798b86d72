"""Engine errors: one class per misuse, so the gRPC layer can map each to its status code.

| exception                  | gRPC status          |
|----------------------------|----------------------|
| UnknownSessionError        | FAILED_PRECONDITION  |
| NoActiveRequestError       | FAILED_PRECONDITION  |
| RequestInProgressError     | FAILED_PRECONDITION  |
| TokenizerMismatchError     | FAILED_PRECONDITION  |
| InvalidTokenError          | INVALID_ARGUMENT     |
| InvalidProbabilityError    | INVALID_ARGUMENT     |
| DraftTooLongError          | INVALID_ARGUMENT     |
| MalformedDraftError        | INVALID_ARGUMENT     |
| FutureRoundError           | INVALID_ARGUMENT     |
| StaleRoundError            | ABORTED              |
| PromptTooLongError         | RESOURCE_EXHAUSTED   |
| LengthLimitError           | RESOURCE_EXHAUSTED   |
| TooManyDraftersError       | RESOURCE_EXHAUSTED   |
| DrainingError              | UNAVAILABLE          |

Besides them, :class:`ListenError`: the daemon could not have a port it was told to listen on.
"""


class ListenError(OSError):
    """A port the process was told to listen on could not be had (in use, not allowed, or not a
    port). Not an engine error: the daemon stops before serving, and the CLI says why."""


class EngineError(Exception):
    """Base class: a request the engine refused. The engine and other sessions are unaffected."""


class UnknownSessionError(EngineError):
    """The session id was never issued, or the session left or was evicted."""


class NoActiveRequestError(EngineError):
    """A draft arrived for a session with no request in progress."""


class RequestInProgressError(EngineError):
    """A new request was started while the session's previous one is still running."""


class TokenizerMismatchError(EngineError):
    """The drafter's tokenizer fingerprint differs from the target's."""


class MalformedDraftError(EngineError):
    """Shapes or fields of a draft do not fit together (lengths, parents, distributions)."""


class InvalidTokenError(MalformedDraftError):
    """A token id outside the target's vocabulary."""


class InvalidProbabilityError(MalformedDraftError):
    """A draft probability that is NaN, <= 0 at a drafted token, > 1, or a row that does not sum to 1."""


class DraftTooLongError(MalformedDraftError):
    """More drafted tokens than the session was allocated for this round."""


class FutureRoundError(MalformedDraftError):
    """A draft for a round the session has not reached."""


class StaleRoundError(EngineError):
    """A draft for a round already verified with different content."""


class PromptTooLongError(EngineError):
    """The prompt alone does not fit the model's context."""


class LengthLimitError(EngineError):
    """Prompt plus max new tokens exceed the context limit."""


class TooManyDraftersError(EngineError):
    """The engine already serves its maximum number of drafters."""


class NotOwnerError(EngineError):
    """The session belongs to another identity."""


class LimitExceededError(EngineError):
    """One of the caller identity's limits (sessions, streams, KV tokens, request rate) would be exceeded."""


class QueueFullError(EngineError):
    """Local serving's wait queue is full: the request was not queued. ``retry_after_s``: about
    when a place frees (the client's retry-after hint)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class DrainingError(EngineError):
    """The verifier is draining: no new sessions or requests."""
