"""Model directories: a local directory as is, a hub id downloaded once per node; its config.json.

On a node, LOCAL_RANK 0 downloads into the huggingface_hub cache while the node's other ranks wait,
then every rank reads the cached files. The wait does not use a collective (its timeout, 600 s by
default, is shorter than a first 31 GB download): the downloader publishes, through the process group's
key-value store, how many bytes have arrived so far and finally "ok" or its error. A waiter waits as long
as that byte count keeps moving, and gives up only after AUTOTP_DOWNLOAD_STALL_TIMEOUT seconds with no
progress. A failed download is the same one-line error on every rank. HF_HUB_OFFLINE=1 is honoured.

Every fetch from the hub (a model, `autotp plan`'s config.json, a --tokenizer id) is watched: huggingface_hub
waits forever on some requests (repo_info and the file listing pass no timeout), so a hub that accepts the
connection and never answers (a broken proxy) would hang. A fetch that gets no new byte for
AUTOTP_HUB_TIMEOUT seconds (30) is an error naming the endpoint; its thread is left behind, blocked.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import torch.distributed as dist
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig

from autotp import distributed, hosts
from autotp.errors import AutotpError
from autotp.model_dir import config_fields, local_dir

WEIGHT_FILES = ["*.json", "*.safetensors", "*.txt", "*.model"]
TOKENIZER_FILES = ["*.json", "*.txt", "*.model"]  # tokenizer.json, vocab.json + merges.txt, SentencePiece
HUB_TIMEOUT_S = 30  # a fetch with no answer and no new byte for this long: the hub stalls (AUTOTP_HUB_TIMEOUT)
STALL_TIMEOUT_S = 300  # no new byte for this long: the download is stuck (AUTOTP_DOWNLOAD_STALL_TIMEOUT)
BEAT_S = 0.5  # how often the downloader publishes its byte count, and waiters look


def resolve_model_dir(model: str | os.PathLike, patterns: list[str] = WEIGHT_FILES, flag: str = "model") -> Path:
    """A local directory as is (model_dir.local_dir); otherwise a hub id, fetched (the files matching `patterns`)
    once per node. flag: what named it, for the error (the CLI's --model or --tokenizer)."""
    path = local_dir(model, flag)
    if path is not None:
        return path
    store = dist.distributed_c10d._get_default_store() if distributed.world_size() > 1 else None
    if store is None:
        return _fetch(str(model), patterns)
    digest = hashlib.sha1(repr(sorted(patterns)).encode()).hexdigest()[:8]
    key = f"autotp/hub/{hosts.key()}/{model}/{digest}"
    if _downloads_for_this_node():
        return _download(store, key, str(model), patterns)
    _wait(store, key, str(model))
    return _snapshot(str(model), patterns, local_files_only=True)


def _downloads_for_this_node() -> bool:
    """LOCAL_RANK 0; without LOCAL_RANK (a script's own mp.spawn), the lowest rank on this host."""
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"]) == 0
    nodes: list = [None] * distributed.world_size()
    dist.all_gather_object(nodes, hosts.key())
    return nodes.index(hosts.key()) == distributed.rank()


def clip(text: str, limit: int = 200) -> str:
    """The first line of `text`, at most `limit` characters, cut between words (with "...") rather than in one."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    if len(line) <= limit:
        return line
    cut = line[:limit].rsplit(" ", 1)[0]
    return (cut if cut else line[:limit]) + " ..."


def _snapshot(repo_id: str, patterns: list[str], local_files_only: bool = False) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=local_files_only))
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError, ValueError) as e:
        if isinstance(e, LocalEntryNotFoundError) and constants.HF_HUB_OFFLINE:
            raise AutotpError(f"cannot find model {repo_id!r}: HF_HUB_OFFLINE is set and it is not in the hub "
                              f"cache ({constants.HF_HUB_CACHE}): fetch it once with the network on, or give a "
                              "local directory") from None
        detail = clip(str(e))
        raise AutotpError(f"cannot find model {repo_id!r} locally or on the hub: {type(e).__name__}"
                          + (f": {detail}" if detail else "")) from None


def _fetch(repo_id: str, patterns: list[str], publish=lambda cached: None) -> Path:
    """`_snapshot` in a thread, watched: an AutotpError naming the endpoint when it neither returns nor adds
    a byte to the cache for AUTOTP_HUB_TIMEOUT seconds. `publish(cached bytes)` is called every BEAT_S."""
    from huggingface_hub import constants

    timeout_s = float(os.environ.get("AUTOTP_HUB_TIMEOUT", HUB_TIMEOUT_S))
    outcome: dict = {}

    def fetch() -> None:
        try:
            outcome["dir"] = _snapshot(repo_id, patterns)
        except BaseException as e:  # noqa: BLE001 - raised again by the watching thread
            outcome["error"] = e

    worker = threading.Thread(target=fetch, daemon=True, name="autotp-hub-fetch")
    worker.start()
    seen, since = _cached_bytes(repo_id), time.monotonic()
    while worker.is_alive():
        worker.join(BEAT_S)
        cached = _cached_bytes(repo_id)
        publish(cached)
        if cached != seen:
            seen, since = cached, time.monotonic()
        elif worker.is_alive() and time.monotonic() - since > timeout_s:
            raise AutotpError(f"the hub at {constants.ENDPOINT} sent nothing for {timeout_s:.0f} s while fetching "
                              f"{repo_id!r} (AUTOTP_HUB_TIMEOUT; HF_ENDPOINT names the hub, HF_HUB_OFFLINE=1 "
                              "uses the cache only)")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["dir"]


def _cached_bytes(repo_id: str) -> int:
    """Bytes under the repo's folder of the hub cache, partial downloads included: the progress signal."""
    from huggingface_hub import constants

    root = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass  # renamed from .incomplete to its blob name between walk and stat
    return total


def _download(store, key: str, repo_id: str, patterns: list[str]) -> Path:
    try:
        local = _fetch(repo_id, patterns, publish=lambda cached: store.set(f"{key}/bytes", str(cached)))
    except BaseException as e:  # whatever ends the download, the waiting ranks must hear of it, not stall
        reason = str(e) if isinstance(e, AutotpError) else f"the download of {repo_id!r} by LOCAL_RANK 0 failed: " \
                                                             f"{type(e).__name__}"
        store.set(f"{key}/status", f"error:{reason}")
        raise
    store.set(f"{key}/status", "ok")
    return local


def _wait(store, key: str, repo_id: str) -> None:
    """Until the node's downloader says "ok" (return) or fails (raise its error); raise after a stall."""
    stall_s = float(os.environ.get("AUTOTP_DOWNLOAD_STALL_TIMEOUT", STALL_TIMEOUT_S))
    seen, since = None, time.monotonic()
    while not store.check([f"{key}/status"]):
        progress = store.get(f"{key}/bytes") if store.check([f"{key}/bytes"]) else None
        if progress != seen:
            seen, since = progress, time.monotonic()
        elif time.monotonic() - since > stall_s:
            raise AutotpError(f"the download of {repo_id!r} by LOCAL_RANK 0 made no progress for {stall_s:.0f} s "
                              "(AUTOTP_DOWNLOAD_STALL_TIMEOUT)")
        time.sleep(BEAT_S)
    status = store.get(f"{key}/status").decode()
    if status != "ok":
        raise AutotpError(status.removeprefix("error:"))


def load_config(model_dir: Path):
    """config.json as a transformers config; one that is missing or no JSON object (model_dir.config_fields), or
    that transformers rejects (its strict fields, e.g. a string for n_layer), is an AutotpError naming the file."""
    config_fields(model_dir)
    try:
        return AutoConfig.from_pretrained(model_dir)
    except (ValueError, KeyError, OSError, StrictDataclassError) as e:
        raise AutotpError(f"cannot read {model_dir / 'config.json'}: {' '.join(str(e).split())}") from None
