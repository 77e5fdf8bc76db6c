"""Pure decisions of the warm pool: which worker command a fork can run, which environment it needs, what to preload.

A forked worker runs in an interpreter that started before it: it can be the process torchrun's
``Popen`` would have started only where nothing the interpreter reads at start-up differs. These
functions say where that holds; everything else is started as a plain subprocess.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

#: Variables torch's agent and ours set per worker, all read after start-up (by ``init_process_group``, the
#: strategy, NCCL at communicator creation): a worker may differ from the zygote in these only.
PER_WORKER_NAMES = frozenset({
    "RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
    "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES",
})
PER_WORKER_PREFIXES = ("TORCHELASTIC_", "UNICRON_", "NCCL_", "TORCH_NCCL_")
#: What a package imports on first use that every training process reaches: torch's first optimizer imports
#: ``torch._dynamo`` (about 1.3 s here), so ``auto`` preloads it with torch.
FIRST_USE_IMPORTS = {"torch": ("torch._dynamo",)}


@dataclass(frozen=True)
class PythonCommand:
    """A worker command the zygote's interpreter can run: ``python [-u] SCRIPT ARGS`` or ``python [-u] -m MODULE ARGS``.

    Attributes:
        script: The script's path (None for a module).
        module: The module's name (None for a script).
        args: The arguments after the script or module.
        unbuffered: ``-u``: stdout and stderr unbuffered (torchrun passes it).
    """

    script: str | None
    module: str | None
    args: tuple[str, ...]
    unbuffered: bool

    def sys_argv(self) -> list[str]:
        """``sys.argv`` as the interpreter sets it (a module's ``argv[0]`` is set by ``runpy`` from its file)."""
        return [self.script if self.script is not None else "-m", *self.args]

    def sys_path0(self, cwd: str) -> str:
        """``sys.path[0]`` as the interpreter sets it: the script's real directory, or the working directory."""
        if self.script is not None:
            return os.path.dirname(os.path.realpath(os.path.join(cwd, self.script)))
        return cwd


def parse_command(args: Sequence[str], executable: str) -> PythonCommand | str:
    """The worker command as a :class:`PythonCommand`, or why a fork cannot run it.

    Args:
        args: The command torch would start: the interpreter, its options, the script or ``-m MODULE``, arguments.
        executable: The zygote's interpreter (``sys.executable``).

    Returns:
        The command, or the reason (a sentence) it needs a plain subprocess.
    """
    if not args or os.path.realpath(str(args[0])) != os.path.realpath(executable):
        return f"the entrypoint {str(args[0]) if args else ''!r} is not this Python ({executable})"
    unbuffered, rest = False, [str(a) for a in args[1:]]
    while rest:
        option = rest.pop(0)
        if option == "-u":
            unbuffered = True
        elif option == "-m" and rest:
            return PythonCommand(None, rest[0], tuple(rest[1:]), unbuffered)
        elif option.startswith("-m") and len(option) > 2:
            return PythonCommand(None, option[2:], tuple(rest), unbuffered)
        elif option.startswith("-"):
            return f"the interpreter option {option!r} (a fork runs -u, -m and scripts only)"
        else:
            return PythonCommand(option, None, tuple(rest), unbuffered)
    return "no script or module to run"


def env_mismatch(zygote: Mapping[str, str], worker: Mapping[str, str]) -> list[str]:
    """The variables a worker's environment sets differently from the zygote's that start-up may have read.

    Returns:
        Their names, sorted (empty: a fork of the zygote is the process a fresh interpreter would be).
    """
    names = set(zygote) | set(worker)
    return sorted(n for n in names if zygote.get(n) != worker.get(n)
                  and n not in PER_WORKER_NAMES and not n.startswith(PER_WORKER_PREFIXES))


def module_imports(source: str) -> list[str]:
    """The absolute imports at a module's top level (also inside its top-level ``if``/``try``), in order.

    ``import a.b`` gives ``a.b``; ``from a.b import c`` gives ``a.b``; relative imports are left out.
    """
    found: list[str] = []

    def visit(body: Iterable[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                found.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append(node.module)
            elif isinstance(node, ast.If):
                visit(node.body), visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body), visit(node.orelse)

    visit(ast.parse(source).body)
    return list(dict.fromkeys(found))


def auto_preload(command: PythonCommand, cwd: str) -> tuple[str, ...]:
    """``--preload auto``: the installed packages the script (or module) imports at its top level, in its order.

    Modules of the standard library and those found next to the script (or in the working directory,
    for a module) are left out: the zygote imports packages, never the user's own code. A training
    script imports torch (and Lightning, megatron-core) there; one that imports nothing installed
    gets nothing preloaded (its forks still skip the interpreter's start).
    """
    source_path, local_dir = _source(command, cwd)
    chosen: list[str] = []
    try:
        with open(source_path, encoding="utf-8") as file:
            imports = module_imports(file.read())
    except (OSError, SyntaxError, ValueError, TypeError):
        imports = []
    for name in imports:
        top = name.split(".")[0]
        if top in sys.stdlib_module_names or top == "__future__":
            continue
        if _installed(top, local_dir):
            chosen += [name, *FIRST_USE_IMPORTS.get(name, ())]
    return tuple(dict.fromkeys(chosen))


def _source(command: PythonCommand, cwd: str) -> tuple[str | None, str]:
    """The file whose imports ``auto`` reads and the directory of the user's own modules."""
    if command.script is not None:
        path = os.path.realpath(os.path.join(cwd, command.script))
        return path, os.path.dirname(path)
    if not command.module or "." in command.module:  # (finding a submodule would import its package here)
        return None, cwd
    try:
        spec = importlib.util.find_spec(command.module)
    except (ImportError, ValueError):
        spec = None
    return (spec.origin if spec is not None else None), cwd


def _installed(top: str, local_dir: str) -> bool:
    """Whether top-level package ``top`` is found, and not in ``local_dir`` (the user's own code)."""
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return False
    if spec is None:
        return False
    locations = [spec.origin] if spec.origin not in (None, "built-in", "frozen") else []
    locations += list(spec.submodule_search_locations or [])
    local = os.path.realpath(local_dir) + os.sep
    return bool(locations) and not any(os.path.realpath(str(p)).startswith(local) for p in locations)


def argv_block(args: Sequence[str]) -> bytes:
    """The bytes ``/proc/PID/cmdline`` shows for ``args`` (each NUL-terminated)."""
    return b"".join(os.fsencode(str(a)) + b"\0" for a in args)


def env_block(env: Mapping[str, str]) -> bytes:
    """The bytes ``/proc/PID/environ`` shows for ``env`` (each ``NAME=VALUE`` NUL-terminated)."""
    return b"".join(os.fsencode(f"{name}={value}") + b"\0" for name, value in env.items())


#: What fills a worker's ``/proc/PID/environ`` after its own variables, up to the zygote's room (spaces follow).
ROOM_HEADER = b"UNICRON_ZYGOTE_ROOM="


def proc_image(block: bytes, room: int, filler: bytes = b"") -> bytes:
    """``block`` padded to ``room`` bytes: with ``filler`` then spaces and a NUL where it fits, else NULs.

    Raises:
        ValueError: ``block`` is larger than ``room``.
    """
    if len(block) > room:
        raise ValueError(f"{len(block)} bytes do not fit in {room}")
    rest = room - len(block)
    if filler and rest >= len(filler) + 1:
        return block + filler + b" " * (rest - len(filler) - 1) + b"\0"
    return block + b"\0" * rest


def room_for(block: bytes) -> int:
    """The room the zygote keeps for a worker's command line or environment: twice the block's size, and 16 KiB."""
    return 2 * len(block) + 16384
