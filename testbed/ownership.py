"""Files made under sudo belong to the user who ran sudo, not to root.

`testbed run` (root) writes a run directory; `plot`, `report` and `analyse` add to one. Each
hands what it made back to the invoking user, `SUDO_UID`/`SUDO_GID` as sudo sets them, with
lchown (symbolic links are never followed). Without sudo (no SUDO_UID, or not root) nothing
changes. The compiled delay line is not handed back: it runs as root and stays root's.
"""

import contextlib
import os
import pathlib


def invoking_user():
    """(uid, gid) of the user who ran sudo, or None when there is nothing to hand back."""
    if os.geteuid() != 0:
        return None
    try:
        uid = int(os.environ["SUDO_UID"])
        gid = int(os.environ.get("SUDO_GID", uid))
    except (KeyError, ValueError):
        return None
    return None if uid == 0 else (uid, gid)


def hand_back(*paths, recursive=True):
    """lchown each path (and, with `recursive`, everything below a directory) to the invoking
    user. Paths that vanished meanwhile are skipped. Returns how many entries changed owner."""
    who = invoking_user()
    if who is None:
        return 0
    n = 0
    for path in paths:
        path = pathlib.Path(path)
        with contextlib.suppress(FileNotFoundError):
            os.chown(path, *who)     # the path given (an --out may be a link to a directory)
            n += 1
        if not (recursive and path.is_dir()):
            continue
        for root, dirs, files in os.walk(path):     # never descends into linked directories
            for name in dirs + files:
                with contextlib.suppress(FileNotFoundError):
                    os.lchown(os.path.join(root, name), *who)
                    n += 1
    return n


def missing_ancestors(path):
    """`path` and those of its parents that do not exist yet (made by the caller next), so
    they can be handed back too; the existing ones stay whoever's they are."""
    path = pathlib.Path(path).absolute()
    out = []
    for p in (path, *path.parents):
        if p.exists():
            break
        out.append(p)
    return out
