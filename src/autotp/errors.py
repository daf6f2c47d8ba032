"""The one exception type for bad input: the CLI prints its message as one line and exits non-zero."""


class AutotpError(Exception):
    """A user-facing error: wrong sizes, unsupported model, bad checkpoint. The message names the numbers."""


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one line, `Type: message`, its first line cut to `limit` characters: what a log line, an
    error answer or a rank's failure note says of it (the same on every rank for the same failure)."""
    return f"{type(e).__name__}: {e}".splitlines()[0][:limit]
