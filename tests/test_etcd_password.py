"""The etcd password from a file or the environment, never needed on a command line (issue #9, item 10)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from conftest import BIN, EXAMPLES
from unicron_elastic.api import ConfigError
from unicron_elastic.rendezvous.options import parse_options
from unicron_elastic.store import EmbeddedEtcd
from test_status_cli import enable_auth


@pytest.fixture()
def no_password_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UNICRON_ETCD_PASSWORD", raising=False)


def _secret(tmp_path: Path, text: str = "s3cret\n") -> str:
    path = tmp_path / "etcd-password"
    path.write_text(text)
    path.chmod(0o600)
    return str(path)


def test_password_file(tmp_path: Path, no_password_env: None) -> None:
    opts = parse_options("h:1", "r", {"user": "u", "password_file": _secret(tmp_path)})
    assert (opts.etcd.user, opts.etcd.password) == ("u", "s3cret")  # one trailing newline dropped
    assert parse_options("h:1", "r", {"user": "u", "password_file": _secret(tmp_path, "a b \n")}).etcd.password == "a b "


def test_password_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNICRON_ETCD_PASSWORD", "from-env")
    assert parse_options("h:1", "r", {"user": "u"}).etcd.password == "from-env"
    assert parse_options("h:1", "r", {}).etcd.password is None  # no user: no authentication


def test_password_value_still_accepted(no_password_env: None) -> None:
    assert parse_options("h:1", "r", {"user": "u", "password": "p"}).etcd.password == "p"


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        ({"user": "u"}, "password_file=PATH or UNICRON_ETCD_PASSWORD"),
        ({"user": "u", "password": "p", "password_file": "/x"}, "either --rdzv-conf password or --rdzv-conf password_file"),
        ({"password_file": "/x"}, "user"),
        ({"password": "p"}, "user"),
        ({"user": "u", "password_file": "/nonexistent/pw"}, "password_file '/nonexistent/pw' cannot be read"),
        ({"user": "u", "password_file": "EMPTY"}, "is empty"),
    ],
)
def test_password_errors_name_the_remedy(conf: dict, match: str, tmp_path: Path, no_password_env: None) -> None:
    if conf.get("password_file") == "EMPTY":
        conf = dict(conf, password_file=_secret(tmp_path, ""))
    with pytest.raises(ConfigError, match=match):
        parse_options("h:1", "r", conf)


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_unicron_run_authenticates_with_a_password_file(private_etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    enable_auth(private_etcd)
    env = {k: v for k, v in os.environ.items() if k != "UNICRON_ETCD_PASSWORD"}
    env.update(OMP_NUM_THREADS="1", PATH=BIN + os.pathsep + env["PATH"])
    cmd = [os.path.join(BIN, "unicron-run"), f"--rdzv-endpoint={private_etcd.endpoint}", "--rdzv-id=authrun",
           "--nnodes=1", "--nproc-per-node=1", "--monitor-interval=0.1",
           f"--rdzv-conf=cluster=authrun,user=unicron,password_file={_secret(tmp_path)},last_call_timeout=1",
           os.path.join(EXAMPLES, "allreduce.py"), "--out", str(tmp_path / "out")]
    assert "s3cret" not in " ".join(cmd)
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=100)
    assert res.returncode == 0, res.stderr[-3000:]
    assert list((tmp_path / "out").glob("rank*.json")), res.stderr[-3000:]
