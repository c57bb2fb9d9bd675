"""The service's state directory: what it keeps on disk (the translation memory, translated files
and DeepL jobs, the secret of its keyed hashes), readable by the service's user only.

    AppArgs.state_dir (or $MT_STATE_DIR, service/config.py), else $XDG_STATE_HOME/transformer-mt,
    else ~/.local/state/transformer-mt

Folders are created 0700 and files 0600 (``private_dir``, ``private_file``), whatever the umask.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def state_dir(configured: Optional[str] = None) -> Path:
    """The state directory (not created here): ``configured`` (AppArgs.state_dir), else the XDG one."""
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "transformer-mt"


def private_dir(path: Path) -> Path:
    """``path`` as a folder only its owner can list or enter (0700), created with its parents."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def private_file(path: Path) -> Path:
    """``path`` as a file only its owner can read (0600), created empty if missing."""
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    if path.stat().st_mode & 0o077:
        path.chmod(0o600)
    return path
