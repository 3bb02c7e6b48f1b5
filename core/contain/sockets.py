"""Where the forwarder sockets of this user's contained processes live: one private folder, masked in every sandbox.

Each contained start with a server gets a fresh 0700 folder for its forwarder's socket (`net_folder`), under
one folder per user (`net_root`, in $TMPDIR). `core.contain.contained` masks that folder in every sandbox and
binds back only the sandbox's own socket folder, so a sandbox reaches its own forwarder and no sibling's,
whatever $TMPDIR is: the private /tmp of a sandbox hides nothing when TMPDIR points elsewhere (Slurm's
per-job folders). It makes folders and checks who owns them; it serves, starts and masks nothing.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def net_root() -> Path:
    """The folder that holds every forwarder socket folder of this user (one per contained start): masked in
    every sandbox, which gets only its own socket's folder bound back, so no sandbox reaches a sibling's
    forwarder whatever $TMPDIR is (a private /tmp hides nothing when TMPDIR points elsewhere, as under Slurm)."""
    return Path(tempfile.gettempdir()) / f"swarmrl-net-{os.getuid()}"


def net_folder() -> Path:
    """A fresh 0700 folder for one forwarder's socket, under `net_root()`: made 0700 by us, or refused when
    someone else made it (another user on a shared TMPDIR could otherwise watch or swap the sockets)."""
    root = net_root()
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = root.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise OSError(f"{root} is not a private folder of this user (a link, another user's, or open to others): "
                      "remove it, or point TMPDIR elsewhere")
    return Path(tempfile.mkdtemp(prefix="swarmrl-net-", dir=root))
