"""The process environment: every ``UNICRON_*`` variable, who sets it, who reads it, its one format.

Every reader and writer of a ``UNICRON_*`` variable goes through this leaf (``tests/test_env.py``
checks that no other module names one), and docs/architecture.md's "Process environment" table
is :data:`VARIABLES`. Variables of torchrun (``RANK``, ``MASTER_ADDR``, ...) and knobs of torch
are read or set where they are used.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from unicron_elastic.api import ConfigError


@dataclass(frozen=True)
class Variable:
    """One environment variable of the package.

    Attributes:
        name: The variable.
        format: Its one format.
        set_by: Who sets it.
        read_by: Who reads it.
    """

    name: str
    format: str
    set_by: str
    read_by: str


AGENT_SOCKET = Variable("UNICRON_AGENT_SOCKET", "path of a UNIX datagram socket",
                        "the agent (for its workers)", "`worker.py` (`AgentChannel`)")
MEETING = Variable("UNICRON_MEETING", 'JSON `{"etcd": EtcdConfig without password, "prefix": ".../"}`',
                   "the agent's meeting point (for its workers)", "`meeting.py`, the Lightning strategy")
ETCD_PASSWORD = Variable("UNICRON_ETCD_PASSWORD", "the etcd password",
                         "the user; the agent and the node daemon (for their children)",
                         "`store/endpoints.py`, `meeting.py`")
MAX_WORLD = Variable("UNICRON_MAX_WORLD", "int >= `WORLD_SIZE`",
                     "the agent (for its workers)", "`strategy/lightning/environment.py`")
INCARNATION = Variable("UNICRON_INCARNATION", "`<node>.<rendezvous count>.<restarts>`: this process of its rank",
                       "the agent (for its workers)", "user scripts (the workers' liveness value is the same)")
ROUND = Variable("UNICRON_ROUND", "int >= 0: the run's rendezvous round",
                 "the agent (for its workers)", "the Lightning strategy")
WORKER_RESTARTS = Variable("UNICRON_WORKER_RESTARTS",
                           "int >= 0; > 0: not the rank's first process (respawned, or joining a running round)",
                           "the agent (for its workers)", "the Lightning strategy, `faults.py`, user scripts")
FAULTS = Variable("UNICRON_FAULTS", "JSON list of `Fault` fields", "tests, examples (`faults_env`)", "`faults.py`")
FAULT_LOG = Variable("UNICRON_FAULT_LOG", "path of a JSON-lines file", "tests, examples (`faults_env`)",
                     "`faults.py`")
NODE_DAEMON = Variable("UNICRON_NODE_DAEMON", "the node's name", "the node daemon (for its launcher)",
                       "the agent, its detectors, the rendezvous (`PlanGate`)")
DAEMON_PID = Variable("UNICRON_NODE_DAEMON_PID", "decimal pid", "the node daemon (for its launcher)",
                      "`agent/signals.py`, `rendezvous/gate.py`")
EVENT_RETENTION = Variable("UNICRON_EVENT_RETENTION", "int >= 1 (default 1000)", "the user", "`store/client.py`")
ETCD_BINARY = Variable("UNICRON_ETCD_BINARY", "path of an executable", "the user, tests", "`store/embedded.py`")
LOG_LEVEL = Variable("UNICRON_LOG_LEVEL", "a level name (default INFO)", "the user", "`logging.py`")
ETCD_LAYOUT = Variable("UNICRON_ETCD_LAYOUT", "JSON list of the members' `name`, `host`, `client_port`, `peer_port`",
                       "the SLURM batch script (`unicron slurm layout`, once per job)",
                       "`unicron slurm etcd`, `unicron slurm endpoint`")
LOOPBACK_SLURM_NODE = Variable("UNICRON_LOOPBACK_SLURM_NODE", "`<slurm.conf>:<mark>`",
                               "`slurm/loopback.py` (a loopback slurmd's environment)",
                               "`slurm/loopback.py` (from `/proc/<pid>/environ`)")
PRELOAD = Variable("UNICRON_PRELOAD", "`MODULE[,MODULE...]`, `auto` or `none` (default `none`)", "the user, tests",
                   "`launcher.py` (`--preload`'s default)")
SPARES = Variable("UNICRON_SPARES", "int >= 0 (default 1)", "the user", "`launcher.py` (`--spares`' default)")
ZYGOTE_ROOM = Variable("UNICRON_ZYGOTE_ROOM", "spaces", "the warm pool (for its zygote)",
                       "nobody: it keeps room in `/proc/PID/environ` for a forked worker's environment")

#: Every variable, in the order of docs/architecture.md's table.
VARIABLES: tuple[Variable, ...] = (AGENT_SOCKET, MEETING, ETCD_PASSWORD, MAX_WORLD, INCARNATION, ROUND, WORKER_RESTARTS,
                                   FAULTS, FAULT_LOG, NODE_DAEMON, DAEMON_PID,
                                   EVENT_RETENTION, ETCD_BINARY, LOG_LEVEL, ETCD_LAYOUT, LOOPBACK_SLURM_NODE, PRELOAD,
                                   SPARES, ZYGOTE_ROOM)


def _text(variable: Variable) -> str | None:
    """The variable's value, or None when it is unset or empty."""
    return os.environ.get(variable.name) or None


def _int(variable: Variable, default: int, minimum: int) -> int:
    """The variable as an int >= ``minimum``; ``default`` when unset or empty.

    Raises:
        ConfigError: It is set and not a whole number >= ``minimum``.
    """
    raw = os.environ.get(variable.name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {variable.name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ConfigError(f"environment variable {variable.name}={raw!r} must be a whole number >= {minimum}")
    return value


# -- the agent and its workers ---------------------------------------------------------------

def agent_socket() -> str:
    """The agent's socket path (``""`` outside ``unicron-run``)."""
    return os.environ.get(AGENT_SOCKET.name, "")


def set_agent_socket(path: str) -> None:
    """Tell the workers started next where the agent's socket is."""
    os.environ[AGENT_SOCKET.name] = path


def meeting_text() -> str | None:
    """The meeting space's description (:data:`MEETING`), or None outside ``unicron-run``."""
    return _text(MEETING)


def set_meeting(text: str, password: str | None) -> None:
    """Tell the workers started next the meeting space (and the etcd password, unless already set)."""
    os.environ[MEETING.name] = text
    if password is not None:
        os.environ.setdefault(ETCD_PASSWORD.name, password)


def clear_meeting() -> None:
    """Forget the meeting space (the round is over)."""
    os.environ.pop(MEETING.name, None)


def etcd_password() -> str | None:
    """The etcd password from the environment, or None."""
    return _text(ETCD_PASSWORD)


def max_world(default: int) -> int:
    """How many ranks may join the run (:data:`MAX_WORLD`); ``default`` when unset.

    Raises:
        ConfigError: It is set and not an integer (its bound, ``WORLD_SIZE``, is the reader's check).
    """
    raw = os.environ.get(MAX_WORLD.name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {MAX_WORLD.name}={raw!r} is not an integer") from None


def set_max_world(ranks: int) -> None:
    """Tell the workers started next how many ranks may join the run."""
    os.environ[MAX_WORLD.name] = str(ranks)


def incarnation(node: str, rendezvous_count: int, restarts: int) -> str:
    """A process of a rank: ``<node>.<rendezvous count>.<restarts>`` (:data:`INCARNATION`, its liveness value)."""
    return f"{node}.{rendezvous_count}.{restarts}"


def set_group_start(node: str, rendezvous_count: int) -> None:
    """Tell the workers of a group start their incarnation."""
    os.environ[INCARNATION.name] = incarnation(node, rendezvous_count, 0)


def respawn_env(node: str, rendezvous_count: int, restarts: int) -> dict[str, str]:
    """The variables of a rank's respawned process: its incarnation and restart count."""
    return {INCARNATION.name: incarnation(node, rendezvous_count, restarts), WORKER_RESTARTS.name: str(restarts)}


def set_round(round_: int) -> None:
    """Tell the workers started next the run's rendezvous round."""
    os.environ[ROUND.name] = str(round_)


def round_() -> int:
    """The run's rendezvous round (0 when unset).

    Raises:
        ConfigError: It is set and not an integer >= 0.
    """
    return _int(ROUND, 0, 0)


def set_joiner() -> None:
    """The workers started next join a running round (from a replica): not their ranks' first processes."""
    os.environ[WORKER_RESTARTS.name] = "1"


def worker_restarts() -> int:
    """How many processes this rank had before this one (0 when unset).

    Raises:
        ConfigError: It is set and not an integer >= 0.
    """
    return _int(WORKER_RESTARTS, 0, 0)


def first_incarnation() -> bool:
    """Whether this is its rank's first incarnation: no respawn, no join, no torchrun restart."""
    return (os.environ.get(WORKER_RESTARTS.name, "0") == "0"
            and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")


# -- faults (tests and examples) --------------------------------------------------------------

def faults_text() -> str | None:
    """The faults to inject (:data:`FAULTS`, JSON), or None."""
    return _text(FAULTS)


def fault_log_path() -> str | None:
    """Where fired faults are logged (:data:`FAULT_LOG`), or None."""
    return _text(FAULT_LOG)


# -- the node daemon and its launcher -----------------------------------------------------------

def node_daemon() -> str | None:
    """The node's name when a node daemon started this launcher, else None."""
    return _text(NODE_DAEMON)


def daemon_pid() -> int | None:
    """The pid of the node daemon that started this launcher, else None (also when malformed)."""
    raw = os.environ.get(DAEMON_PID.name, "")
    return int(raw) if raw.isdigit() else None


def launcher_environment(node: str, pid: int, password: str | None,
                         base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A launcher's environment under a node daemon: ``base`` (this process's) plus the daemon's variables."""
    env = dict(os.environ if base is None else base)
    env[NODE_DAEMON.name] = node
    env[DAEMON_PID.name] = str(pid)
    if password:
        env[ETCD_PASSWORD.name] = password
    return env


# -- the user's settings ------------------------------------------------------------------------

def event_retention(default: int) -> int:
    """Events kept under ``events/`` (:data:`EVENT_RETENTION`); ``default`` when unset.

    Raises:
        ConfigError: It is set and not a whole number >= 1.
    """
    raw = os.environ.get(EVENT_RETENTION.name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{EVENT_RETENTION.name}={raw!r} must be a whole number >= 1")
    return value


def etcd_layout() -> str | None:
    """The etcd members the batch script decided for the job (``unicron slurm layout``), or None."""
    return _text(ETCD_LAYOUT)


def etcd_binary() -> str | None:
    """The etcd binary the user named, or None."""
    return _text(ETCD_BINARY)


def log_level(default: str = "INFO") -> str:
    """The log level the user named, else ``default``."""
    return os.environ.get(LOG_LEVEL.name, default)


# -- the warm pool ---------------------------------------------------------------------------

def preload(default: str) -> str:
    """``--preload``'s default (:data:`PRELOAD`), ``default`` when unset or empty."""
    return _text(PRELOAD) or default


def spares(default: int) -> int:
    """``--spares``' default (:data:`SPARES`).

    Raises:
        ConfigError: It is set and not a whole number >= 0.
    """
    return _int(SPARES, default, 0)
