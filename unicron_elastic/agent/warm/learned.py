"""What workers of a script imported after they started: ``--preload auto`` preloads it in the next zygote.

A training process imports much on first use (torch's optimizer imports ``torch._dynamo``, Lightning's fit
``torch._inductor`` and the strategy megatron-core: seconds here). Each forked worker that ends records the
modules it imported beyond what its zygote had (a JSON file per script and interpreter, under
``$XDG_CACHE_HOME/unicron/warm`` or ``~/.cache/unicron/warm``), as Android's zygote preloads the classes a
profile found; the next zygote for that script imports them too. The file holds module names only;
a name that no longer imports is skipped by the zygote.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

#: At most this many names are kept per script (the newest run's first).
MAX_MODULES = 4000


def cache_path(script: str | None, module: str | None, cwd: str) -> Path:
    """The file of a script's (or module's) learned imports, for this interpreter."""
    what = os.path.realpath(os.path.join(cwd, script)) if script is not None else f"-m {module}"
    key = hashlib.sha256(f"{sys.executable}\0{what}".encode()).hexdigest()[:24]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "unicron" / "warm" / f"{key}.json"


def read(path: Path) -> list[str]:
    """The learned module names ([] when there is none, or it is unreadable)."""
    try:
        names = json.loads(path.read_text()).get("modules", [])
    except (OSError, ValueError, AttributeError):
        return []
    return [n for n in names if isinstance(n, str) and all(part.isidentifier() for part in n.split("."))]


def record(path: Path, imported: Iterable[str], local_dir: str) -> None:
    """Add the modules a worker imported (``imported``) to the learned ones, written atomically.

    Left out: ``__main__``, private names at the top (``_frozen...``), and modules of the user's own
    code (found in ``local_dir``). Errors are ignored: learning is an optimisation.
    """
    local = os.path.realpath(local_dir) + os.sep
    fresh = [name for name in imported if name != "__main__" and not name.startswith("_")
             and not _local(name, local)]
    names = list(dict.fromkeys([*fresh, *read(path)]))[:MAX_MODULES]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"modules": names}))
        os.replace(partial, path)
    except OSError:
        pass


def _local(name: str, local: str) -> bool:
    """Whether module ``name`` (imported in this process) is a file under ``local``."""
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and os.path.realpath(path).startswith(local)
