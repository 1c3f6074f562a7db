"""Secure bind defaults: every shipped config and `qvpic serve` listen on loopback unless told otherwise, and a wider
bind without API keys is refused unless explicitly accepted, with a warning at every start."""

from __future__ import annotations

import ipaddress
import re

import pytest
import yaml

from jobs import run_server
from serve.governance.auth import exposure, is_loopback, key_digest
from serve.governance.config import AuthConfig
from tests.support.paths import REPO

ROOT = REPO
SHIPPED = [ROOT / "serve" / "config.yaml", ROOT / "serve" / "config-gpu.yaml"]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_serve_configs_listen_on_loopback(path):
    """A shipped config is what people run: `serve run` on it must not open an unauthenticated API to the network."""
    config = yaml.safe_load(path.read_text())
    assert ipaddress.ip_address(config["http_options"]["host"]).is_loopback  # judged by the stdlib, not our helper
    assert not config["applications"][0]["args"]["ingress"]["governance"].get("auth", {}).get("insecure_no_auth")
    ns = run_server.parser().parse_args(["--config", str(path)])
    assert run_server.http_host(ns) == config["http_options"]["host"]  # qvpic serve reads the file's bind


def test_the_ray_dashboard_stays_on_the_heads_loopback():
    commands = yaml.safe_load((ROOT / "cluster.yaml").read_text())["head_start_ray_commands"]
    heads = [c for c in commands if "ray start --head" in c]
    assert heads and all(re.search(r"--dashboard-host[= ]127\.0\.0\.1\b", c) for c in heads), heads


def test_qvpic_serve_defaults_to_loopback():
    assert run_server.http_host(run_server.parser().parse_args(["--store", "/data/store"])) == "127.0.0.1"


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7", "qvpic.example.com"])
def test_an_open_bind_without_keys_is_refused(host, capsys):
    assert run_server.main(["--store", "/data/store", "--host", host]) == 2
    assert f"refusing to listen on {host} with no API keys" in capsys.readouterr().err


def test_an_accepted_open_bind_warns_at_start(capsys):
    run_server.main(["--store", "/data/store", "--host", "0.0.0.0", "--insecure-no-auth"])  # then: no such store
    err = capsys.readouterr().err
    assert "WARNING: listening on 0.0.0.0 with no API keys" in err and "refusing" not in err


def test_an_open_bind_with_keys_starts_without_warning(tmp_path, capsys):
    config = yaml.safe_load(SHIPPED[0].read_text())
    config["http_options"]["host"] = "0.0.0.0"
    governance = config["applications"][0]["args"]["ingress"]["governance"]
    governance["auth"] = {"api_key_sha256": {key_digest("key-acme-1"): "acme"}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    run_server.main(["--config", str(path), "--store", "/data/store"])
    err = capsys.readouterr().err
    assert "refusing" not in err and "WARNING" not in err


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True),
                                            ("[::1]", True), ("localhost", True), ("0.0.0.0", False),
                                            ("::", False), ("192.168.1.2", False), ("localhost.evil.com", False)])
def test_loopback_is_what_the_address_says(host, loopback):
    assert is_loopback(host) is loopback
    if not loopback:
        with pytest.raises(ValueError, match="refusing"):
            exposure(host, AuthConfig())
        assert exposure(host, AuthConfig(insecure_no_auth=True)).startswith("WARNING")


def test_the_ingress_refuses_an_open_bind_that_serve_deploy_would_make(monkeypatch, caplog):
    """`serve run` / `serve deploy` never pass through `qvpic serve`: the Ingress replica checks the proxies' bind."""
    from serve.config import IngressConfig
    from serve.http import ingress

    monkeypatch.setattr(ingress, "serve_http_host", lambda: "0.0.0.0")
    with pytest.raises(ValueError, match="refusing to listen on 0.0.0.0"):
        ingress.refuse_open_bind(IngressConfig())
    accepted = IngressConfig.model_validate({"governance": {"auth": {"insecure_no_auth": True}}})
    ingress.refuse_open_bind(accepted)
    assert "WARNING: listening on 0.0.0.0" in caplog.text
    monkeypatch.setattr(ingress, "serve_http_host", lambda: "127.0.0.1")
    ingress.refuse_open_bind(IngressConfig())


@pytest.mark.parametrize("contents", ["", "\n\n", "# keys are rotated on 2026-12-03\n"])
def test_an_empty_key_file_is_no_keys(tmp_path, capsys, contents):
    """A key file counts for the keys it holds: an empty Secret (or one of comments) must not open the bind; the
    same file holding one key does."""
    keys = tmp_path / "api-keys"
    keys.write_text(contents)
    config = yaml.safe_load(SHIPPED[0].read_text())
    config["http_options"]["host"] = "0.0.0.0"
    config["applications"][0]["args"]["ingress"]["governance"]["auth"] = {"api_key_sha256_file": str(keys)}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    assert run_server.main(["--config", str(path), "--store", "/data/store"]) == 2
    assert "refusing to listen on 0.0.0.0 with no API keys" in capsys.readouterr().err
    with pytest.raises(ValueError, match="refusing"):
        exposure("0.0.0.0", AuthConfig(api_key_sha256_file=keys))
    keys.write_text(contents + f"{key_digest('key-acme-1')} acme\n")  # the control: one key, and the bind opens
    assert exposure("0.0.0.0", AuthConfig(api_key_sha256_file=keys)) is None
    keys.unlink()  # an unmounted Secret: refused, naming the file (not its directory)
    with pytest.raises(ValueError, match="cannot read the API key file 'api-keys'"):
        exposure("0.0.0.0", AuthConfig(api_key_sha256_file=keys))
