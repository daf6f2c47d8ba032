"""The one exception type for bad input: the CLI prints its message as one line and exits non-zero."""


class AutotpError(Exception):
    """A user-facing error: wrong sizes, unsupported model, bad checkpoint. The message names the numbers."""
