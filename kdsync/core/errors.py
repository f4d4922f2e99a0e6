"""The errors the core raises (h11's split: who is to blame)."""


class ProtocolError(Exception):
    """Base class of every error the core raises."""


class LocalProtocolError(ProtocolError):
    """The adapter used the core wrongly (a bug in the caller)."""


class RemoteProtocolError(ProtocolError):
    """A peer sent something malformed; log it, drop it, carry on."""
