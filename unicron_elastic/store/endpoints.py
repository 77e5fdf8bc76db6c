"""How to reach etcd: a list of members (``HOST[:PORT][,HOST[:PORT]...]``) and the password (pure).

Shared by the ``unicron`` commands' flags (:mod:`~unicron_elastic.cli_options`) and the rendezvous'
``--rdzv-conf`` (:mod:`~unicron_elastic.rendezvous.options`), each naming its own settings in errors.
"""

from __future__ import annotations

from unicron_elastic.api import ConfigError
from unicron_elastic.env import ETCD_PASSWORD
from unicron_elastic.env import etcd_password as env_password

_PASSWORD_FILE_MAX = 4096


def _read_password_file(path: str, name: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(_PASSWORD_FILE_MAX + 1)
        text = raw.decode()
    except OSError as exc:
        raise ConfigError(f"{name} {path!r} cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{name} {path!r} is not UTF-8 text") from None
    if len(raw) > _PASSWORD_FILE_MAX:
        raise ConfigError(f"{name} {path!r} is longer than {_PASSWORD_FILE_MAX} bytes")
    text = text.removesuffix("\n").removesuffix("\r")
    if not text:
        raise ConfigError(f"{name} {path!r} is empty")
    return text


def etcd_password(
    user: str | None,
    password: str | None = None,
    password_file: str | None = None,
    *,
    names: dict[str, str],
) -> str | None:
    """The etcd password of ``user``: given, read from a file, or from ``$UNICRON_ETCD_PASSWORD``.

    Args:
        user: The etcd user; None means no authentication.
        password: A password given directly (visible in ``ps``; kept for compatibility).
        password_file: A file whose content (minus one trailing newline) is the password.
        names: How to name the settings in error messages (keys ``user``, ``password``,
            ``password_file``, ``file_hint``).

    Returns:
        The password, or None when there is no user.

    Raises:
        ConfigError: Both or neither of the sources are given for a user, a
            source is given without a user, or the file cannot be read or is empty.
    """
    if password is not None and password_file is not None:
        raise ConfigError(f"give either {names['password']} or {names['password_file']}, not both")
    if user is None:
        if password is not None or password_file is not None:
            given = names["password"] if password is not None else names["password_file"]
            raise ConfigError(f"{given} needs {names['user']}")
        return None
    if password_file is not None:
        return _read_password_file(password_file, names["password_file"])
    if password is not None:
        return password
    from_env = env_password()
    if from_env:
        return from_env
    raise ConfigError(f"{names['user']} {user!r} needs a password: {names['file_hint']} or {ETCD_PASSWORD.name}")


def parse_endpoints(endpoints: str, flag: str = "--rdzv-endpoint") -> tuple[tuple[str, int], ...]:
    """Split a comma-separated list of etcd members, ``HOST[:PORT][,HOST[:PORT]...]`` (as ``etcdctl --endpoints``).

    Args:
        endpoints: The list (one member is a list of one).
        flag: The option or variable it came from, for errors.

    Returns:
        Each member's ``(host, port)``, in the order given.

    Raises:
        ConfigError: The list is empty, an entry is empty or malformed, or a
            member is named twice; the message names the entry.
    """
    entries = [entry.strip() for entry in (endpoints or "").split(",")]
    if entries == [""]:
        raise ConfigError(f"{flag} must name the etcd members as HOST:PORT[,HOST:PORT...]")
    members = []
    for entry in entries:
        if not entry:
            raise ConfigError(f"{flag} {endpoints!r}: an empty entry in the list")
        members.append(parse_endpoint(entry, flag=flag))
    if len(set(members)) != len(members):
        raise ConfigError(f"{flag} {endpoints!r}: a member is named twice")
    return tuple(members)


def parse_endpoint(endpoint: str, default_port: int = 2379, flag: str = "--rdzv-endpoint") -> tuple[str, int]:
    """Split ``HOST[:PORT]`` (IPv6 in brackets) into host and port.

    Raises:
        ConfigError: The endpoint is empty or malformed, or its port is not a number.
    """
    endpoint = (endpoint or "").strip()
    if not endpoint:
        raise ConfigError(f"{flag} must name the etcd server as HOST:PORT")
    if endpoint.startswith("["):
        host, _, rest = endpoint[1:].partition("]")
        port_text = rest.lstrip(":")
    elif endpoint.count(":") == 1:
        host, port_text = endpoint.split(":")
    else:
        host, port_text = endpoint, ""
    if not host or any(c.isspace() or c in "/,@" for c in host):
        raise ConfigError(f"{flag} {endpoint!r}: not HOST[:PORT]")
    if not port_text:
        return host, default_port
    try:
        return host, int(port_text)
    except ValueError:
        raise ConfigError(f"{flag} {endpoint!r}: port {port_text!r} is not a number") from None
