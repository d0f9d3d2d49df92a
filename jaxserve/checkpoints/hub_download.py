"""Downloads from the Hugging Face hub, with the hub's failures said plainly.

huggingface_hub does the work: its cache layout, HF_TOKEN, retries and progress bars
(HF_HUB_DISABLE_PROGRESS_BARS=1 hides them). This module fetches only the top-level
files it is told to (subfolders hold formats jaxserve never reads: onnx/, original/),
reads HF_HUB_OFFLINE and HF_ENDPOINT at call time (huggingface_hub reads them once, at
import), and turns every hub exception into a ValueError naming the repo and what to do.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger("jaxserve")

_TRUE = ("1", "ON", "YES", "TRUE")   # huggingface_hub's spellings of true
_SUBFOLDERS = ["*/*"]


def offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set now or when huggingface_hub loaded."""
    from huggingface_hub import constants   # (heavy: loaded only when the hub is asked)
    now = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return now.upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def endpoint() -> str:
    """The hub's address: HF_ENDPOINT now, else what huggingface_hub read at import."""
    from huggingface_hub import constants   # (heavy: loaded only when the hub is asked)
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def download(repo_id: str, patterns: list[str], *, revision: str | None, cache: Path,
             what: str) -> Path:
    """The snapshot directory of `repo_id` at `revision` (None: main) in the HF cache
    `cache`, after fetching the top-level files matching `patterns` it lacks.
    `what` names the files in the log line."""
    from huggingface_hub import snapshot_download   # (heavy: see offline)
    rev = revision or "main"
    logger.info("downloading the %s of %s (revision %s) from %s into %s", what, repo_id, rev,
                endpoint(), cache)
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                      allow_patterns=patterns, ignore_patterns=_SUBFOLDERS,
                                      endpoint=endpoint()))
    except Exception as e:   # the hub's, httpx's or the disk's: all end the download
        raise ValueError(hub_error(repo_id, rev, e)) from e


def hub_error(repo_id: str, revision: str, error: Exception) -> str:
    """What went wrong fetching `repo_id`, and what to do about it."""
    # (heavy: loaded only when the hub is asked, see offline)
    from huggingface_hub.utils import (GatedRepoError, HfHubHTTPError,
                                       LocalEntryNotFoundError, OfflineModeIsEnabled,
                                       RepositoryNotFoundError, RevisionNotFoundError)
    hub = endpoint()
    # huggingface_hub wraps some answers (403, 5xx, offline) as "not in the local cache".
    if isinstance(error, LocalEntryNotFoundError) and isinstance(
            error.__cause__, (HfHubHTTPError, OfflineModeIsEnabled)):
        error = error.__cause__
    if isinstance(error, GatedRepoError):   # before its base class, RepositoryNotFoundError
        return (f"{repo_id} is a gated repo on the Hugging Face hub: accept its terms at "
                f"{hub}/{repo_id} while logged in, then set HF_TOKEN to an access token of "
                f"that account (or run `hf auth login`)")
    if isinstance(error, RepositoryNotFoundError):
        return (f"{repo_id} was not found on the Hugging Face hub ({hub}): check the name; "
                f"a private repo needs HF_TOKEN set to a token that can read it")
    if isinstance(error, RevisionNotFoundError):
        return (f"{repo_id} has no revision {revision!r} (branch, tag or commit) on the Hugging "
                f"Face hub ({hub}): check --revision")
    if isinstance(error, OfflineModeIsEnabled):
        return (f"{repo_id} (revision {revision}) is not in the cache and HF_HUB_OFFLINE is on, "
                f"so it cannot be downloaded: unset HF_HUB_OFFLINE")
    if isinstance(error, HfHubHTTPError) and error.response is not None:
        status = error.response.status_code
        token = " (HF_TOKEN's token may lack access)" if status in (401, 403) else ""
        return (f"the Hugging Face hub ({hub}) answered {status} for {repo_id} (revision "
                f"{revision}){token}: {_first_line(error)}")
    if isinstance(error, LocalEntryNotFoundError):   # huggingface_hub's "cannot connect"
        cause = error.__cause__ or error
        return (f"cannot download {repo_id} (revision {revision}): the Hugging Face hub at "
                f"{hub} cannot be reached ({type(cause).__name__}: {_first_line(cause)}). "
                f"Check the network, HF_ENDPOINT or the proxy settings, or fetch it on a "
                f"machine with network (`hf download {repo_id}`) and copy the cache here")
    return (f"downloading {repo_id} (revision {revision}) from {hub} failed: "
            f"{type(error).__name__}: {_first_line(error)}")


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
