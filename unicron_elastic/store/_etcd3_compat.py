"""Workarounds for python3-etcd3 0.13 that the store layer owns (see DESIGN.md).

1. ``etcd3/watch.py`` calls ``six.itervalues`` in the watch thread's ``finally``
   block without importing ``six``; when a watch stream ends (etcd restarted,
   client closed) the thread dies with ``NameError`` and no callback learns that
   its watch is gone. :func:`patch_watch_module` gives the module the one
   function it needs. ``tests/test_store.py`` shows the defect exists.
2. After one failed request an ``Endpoint`` is marked failed for 300 s and the
   client raises ``ValueError('Trying to use a failed node')`` until then, even
   when etcd is back. The store never reuses a client after a connection
   failure; :func:`new_client` is the single place clients are built.
3. With user/password the client attaches the auth token twice: as gRPC call
   credentials and as plain metadata. gRPC refuses call credentials on a
   plaintext channel ("Established channel does not have a sufficient security
   level to transfer call credential"), so every request fails. Without TLS,
   :func:`new_client` drops the call credentials; the metadata still carries the
   token, which is what etcd reads. ``test_user_password_authentication`` shows it.
"""

from __future__ import annotations

import types

import etcd3
import etcd3.watch

from unicron_elastic.api import ConfigError, EtcdConfig


def patch_watch_module() -> bool:
    """Give ``etcd3.watch`` the ``six.itervalues`` it uses but never imports.

    Returns:
        True if the module needed the patch, False if it already had ``six``.
    """
    if hasattr(etcd3.watch, "six"):
        return False
    etcd3.watch.six = types.SimpleNamespace(itervalues=lambda d: iter(list(d.values())))
    return True


def new_client(config: EtcdConfig, member: int = 0) -> etcd3.Etcd3Client:
    """Build a fresh etcd v3 client for one member of ``config``.

    Args:
        config: Where and how to connect.
        member: The index of the member in ``config.members``.

    Returns:
        A new client with its own gRPC channel.

    Raises:
        ConfigError: A TLS file (``ca_cert``, ``cert_key``, ``cert_cert``)
            cannot be read; retrying would not help.
    """
    host, port = config.members[member]
    try:
        client = etcd3.client(
            host=host,
            port=port,
            ca_cert=config.ca_cert,
            cert_key=config.cert_key,
            cert_cert=config.cert_cert,
            timeout=config.request_timeout,
            user=config.user,
            password=config.password,
        )
    except OSError as exc:  # the client reads the TLS files itself
        raise ConfigError(f"etcd TLS file {exc.filename!r} cannot be read: {exc.strerror or exc}") from None
    if config.ca_cert is None:
        client.call_credentials = None  # the token travels as metadata (see 3.)
    return client


patch_watch_module()
