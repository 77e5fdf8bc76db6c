"""TLS options of the status store against a real etcd with mutual TLS."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import time
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from unicron_elastic.api import EtcdConfig, StoreUnavailableError
from unicron_elastic.store import StatusStore, find_etcd_binary, free_port


def _write(path: Path, key, cert) -> tuple[str, str]:
    key_path, cert_path = path.with_suffix(".key"), path.with_suffix(".crt")
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


def _cert(name: str, issuer_key, issuer_name, *, ca: bool = False, server: bool = False):
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name or subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]),
            critical=False,
        )
    cert = builder.sign(issuer_key or key, hashes.SHA256())
    return key, cert


@pytest.fixture()
def tls_etcd(tmp_path: Path):
    ca_key, ca_cert = _cert("unicron-test-ca", None, None, ca=True)
    _, ca_path = _write(tmp_path / "ca", ca_key, ca_cert)
    server = _write(tmp_path / "server", *_cert("server", ca_key, ca_cert.subject, server=True))
    client = _write(tmp_path / "client", *_cert("client", ca_key, ca_cert.subject))
    port, peer = free_port(), free_port()
    proc = subprocess.Popen(
        [
            find_etcd_binary(), "--data-dir", str(tmp_path / "data"), "--log-level", "warn",
            "--listen-client-urls", f"https://127.0.0.1:{port}", "--advertise-client-urls", f"https://127.0.0.1:{port}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"default=http://127.0.0.1:{peer}",
            "--cert-file", server[1], "--key-file", server[0], "--trusted-ca-file", ca_path, "--client-cert-auth",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    config = EtcdConfig(port=port, ca_cert=ca_path, cert_key=client[0], cert_cert=client[1], reconnect_timeout=2)
    deadline = time.monotonic() + 20
    while not StatusStore(config).healthy():
        assert time.monotonic() < deadline and proc.poll() is None, "TLS etcd did not start"
        time.sleep(0.1)
    yield config
    proc.terminate()
    proc.wait(timeout=10)


def test_mutual_tls_round_trip(tls_etcd: EtcdConfig) -> None:
    store = StatusStore(tls_etcd)
    store.put_json("/tls", {"ok": True})
    assert store.get_json("/tls") == {"ok": True}
    store.close()


def test_plaintext_client_cannot_talk_to_a_tls_etcd(tls_etcd: EtcdConfig) -> None:
    plain = StatusStore(EtcdConfig(port=tls_etcd.port, reconnect_timeout=1, request_timeout=0.5))
    with pytest.raises(StoreUnavailableError, match="unreachable"):
        plain.get("/tls")


def test_unicron_status_reads_a_tls_etcd(tls_etcd: EtcdConfig) -> None:
    import os

    from conftest import BIN

    store = StatusStore(tls_etcd)
    store.put_json(store.keys.node("secure-node"), {"state": "running"})
    store.close()
    base = [os.path.join(BIN, "unicron"), "status", "--endpoint", tls_etcd.endpoint, "--timeout", "2"]
    tls = ["--ca-cert", tls_etcd.ca_cert, "--cert", tls_etcd.cert_cert, "--key", tls_etcd.cert_key]
    res = subprocess.run(base + tls, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "secure-node" in res.stdout, res
    half = subprocess.run(base + tls[:4], capture_output=True, text=True, timeout=60)
    assert half.returncode == 2 and "--cert and --key" in half.stderr and half.stderr.count("\n") == 1, half
    missing = subprocess.run(base + ["--ca-cert", "/nonexistent/ca.crt"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "/nonexistent/ca.crt" in missing.stderr, missing
    assert missing.stderr.count("\n") == 1, missing.stderr
