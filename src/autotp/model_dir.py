"""A model (or tokenizer) as a user names it: a local directory, a hub id, or a path that is neither; and a local
directory's config.json read as JSON.

No torch, no transformers, no hub: `autotp serve` asks this before it imports anything heavy (serve/preflight.py),
and hub.py asks the same functions when it resolves and reads a model, so a typo gets one answer, said early.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from autotp.errors import AutotpError


def local_dir(model: str | os.PathLike, flag: str = "model") -> Path | None:
    """The directory `model` names, or None where it is a hub id ("org/name" or "name"). A name that is written
    as a path (./x, /x, ~/x, a/b/c) or names a file is no hub id: an AutotpError says it is not a directory.
    flag: what named it, for the error (the CLI's --model or --tokenizer)."""
    path = Path(model)
    if path.is_dir():
        return path
    if path.exists() or str(model).count("/") > 1 or str(model).startswith((".", "/", "~")):
        raise AutotpError(f"{flag} {str(model)!r} is not a directory")
    return None


def config_fields(model_dir: Path) -> dict:
    """config.json's fields; a missing file, or one that is no JSON object, is an AutotpError naming it."""
    path = model_dir / "config.json"
    if not path.exists():
        raise AutotpError(f"no config.json in {model_dir}")
    try:
        fields = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise AutotpError(f"cannot read {path}: {e}") from None
    if not isinstance(fields, dict):
        raise AutotpError(f"{path} is a JSON {type(fields).__name__}, not an object of config fields")
    return fields
