"""Models by hub name, resolved through huggingface_hub (its cache, progress bars, offline mode, revisions).

    org/name                  an HF Llama repository: config, tokenizer files and safetensors (snapshot_download)
    org/name:file.gguf        one GGUF file of a repository (hf_hub_download)
    org/name@rev[:file.gguf]  at a branch, tag or commit

A local path that exists always wins over a hub name. HF_HUB_OFFLINE=1 (or no network) uses the cache only;
a model that is not there gives one ModelNotFoundError naming the repository, the file and why.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import ModelNotFoundError

# What load_hf_dir reads (loaders/hf.py): nothing else of a repository is downloaded.
HF_DIR_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "*.safetensors",
    "model.safetensors.index.json",
]

_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_NAME = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[^:@\s]+))?(?::(?P<file>[^:@\s]+\.gguf))?$",
                   re.IGNORECASE)


@dataclass(frozen=True)
class HubName:
    repo_id: str
    revision: Optional[str] = None
    filename: Optional[str] = None  # one GGUF file; None: the repository as an HF directory

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "") + (
            f":{self.filename}" if self.filename else "")


def parse_hub_name(name: str) -> Optional[HubName]:
    """The hub name in `name`, or None when it does not look like one (then it can only be a local path)."""
    m = _NAME.match(name)
    if m is None or m.group("repo").endswith((".", "-")) or ".." in m.group("repo"):
        return None
    return HubName(m.group("repo"), m.group("rev"), m.group("file"))


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _offline() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once, at its import; read the environment again so that a value set
    # later in this process (an application, a test) is honoured too.
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or _truthy(os.environ.get("HF_HUB_OFFLINE"))


def _hub_unresolvable() -> bool:
    """Whether the hub's host name does not resolve (no network): then only the cache is looked in, at once,
    rather than after huggingface_hub's retries (~20 s of "Retrying in 1s ... 8s" for a single file)."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    try:
        socket.getaddrinfo(urlparse(constants.ENDPOINT).hostname or "", 443)
    except OSError:
        return True
    return False


def _cache_dir() -> Optional[str]:
    # Same reason as _offline: the cache location is frozen at huggingface_hub's import.
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "hub")
    return None


def resolve_hub_name(hub: HubName) -> Path:
    """A local path (snapshot directory or GGUF file) for `hub`, downloaded into the hub cache when needed."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub import errors as hf_errors

    offline = _offline()
    unreachable = not offline and _hub_unresolvable()
    what = f"{hub.filename} from {hub.repo_id}" if hub.filename else f"{hub.repo_id} (config, tokenizer, safetensors)"
    if hub.revision:
        what += f" at revision {hub.revision}"
    common = dict(revision=hub.revision, cache_dir=_cache_dir(), local_files_only=offline or unreachable)
    try:
        if hub.filename:
            local = hf_hub_download(hub.repo_id, hub.filename, **common)
        else:
            local = snapshot_download(hub.repo_id, allow_patterns=HF_DIR_FILES, **common)
    except hf_errors.LocalEntryNotFoundError as e:  # offline, or the hub unreachable, and not in the cache
        why = ("HF_HUB_OFFLINE is set" if offline else "the hub's host name does not resolve (no network?)"
               if unreachable else "the hub could not be reached")
        raise ModelNotFoundError(
            f"model {what}: not a local path, and not in the Hugging Face cache ({_cache_dir() or 'default location'}) "
            f"while {why}. Download it once with network access, or pass a local directory or .gguf file."
        ) from e
    except (hf_errors.RepositoryNotFoundError, hf_errors.GatedRepoError) as e:
        raise ModelNotFoundError(f"model {what}: the repository was not found or needs access rights "
                                 f"(log in with `hf auth login`): {e}") from e
    except hf_errors.RevisionNotFoundError as e:
        raise ModelNotFoundError(f"model {what}: no such revision: {e}") from e
    except hf_errors.EntryNotFoundError as e:
        raise ModelNotFoundError(f"model {what}: the repository has no such file: {e}") from e
    except (hf_errors.HfHubHTTPError, OSError, ValueError) as e:
        raise ModelNotFoundError(f"model {what}: could not fetch it from the Hugging Face hub: {e}") from e
    path = Path(local)
    if not hub.filename and not (path / "config.json").is_file():
        raise ModelNotFoundError(f"model {what}: the repository has no config.json (a GGUF repository? name the "
                                 f"file: {hub.repo_id}:FILE.gguf)")
    return path


__all__ = ["HubName", "parse_hub_name", "resolve_hub_name", "HF_DIR_FILES"]
