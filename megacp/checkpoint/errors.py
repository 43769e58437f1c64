"""The one error type of checkpoint code."""


class CheckpointError(ValueError):
    """A checkpoint or config that cannot be read, converted or written as asked (one clear line)."""
