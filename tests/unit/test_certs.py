"""``pdserve certs``: the development CA and its certificates (names, identities, key modes),
and server credentials that pick up renewed files."""

from __future__ import annotations

import ipaddress
import os
import stat
from pathlib import Path

import grpc
import pytest

from pdserve.cli.main import main
from pdserve.common.certs import (
    CertificateAuthority,
    PeerKind,
    ReloadingServerCredentials,
    kind_for_name,
    make_dev_certs,
    parse_spiffe_id,
    spiffe_id,
)

x509 = pytest.importorskip("cryptography.x509", reason="pdserve certs needs 'cryptography'")


def _load(path: Path):  # type: ignore[no-untyped-def]
    return x509.load_pem_x509_certificate(path.read_bytes())


def _sans(cert) -> tuple[set[str], set[str], list[str]]:  # type: ignore[no-untyped-def]
    ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = set(ext.get_values_for_type(x509.DNSName))
    ips = {str(ip) for ip in ext.get_values_for_type(x509.IPAddress)}
    uris = list(ext.get_values_for_type(x509.UniformResourceIdentifier))
    return dns, ips, uris


def test_dev_certs_name_hosts_and_identity(tmp_path: Path) -> None:
    issued = make_dev_certs(tmp_path, ["router", "worker-7"], hosts=["pd.internal", "10.1.2.3"],
                            client_names=["alice"])
    by_name = {cert.name: cert for cert in issued}
    assert {c.kind for c in issued} == {PeerKind.SERVICE, PeerKind.WORKER, PeerKind.CLIENT}
    ca = _load(tmp_path / "ca.pem")
    for cert_file in issued:
        cert = _load(cert_file.cert_path)
        cert.verify_directly_issued_by(ca)  # raises if not signed by the CA
        dns, ips, uris = _sans(cert)
        assert {"localhost", cert_file.name} <= dns
        assert {"127.0.0.1", "::1"} <= ips
        assert uris == [spiffe_id(cert_file.kind, cert_file.name)]
        # Private keys are for their owner only.
        assert stat.S_IMODE(os.stat(cert_file.key_path).st_mode) == 0o600
    dns, ips, _ = _sans(_load(by_name["router"].cert_path))
    assert "pd.internal" in dns and "10.1.2.3" in ips
    eku = _load(by_name["alice"].cert_path).extensions.get_extension_for_class(
        x509.ExtendedKeyUsage).value
    assert x509.oid.ExtendedKeyUsageOID.SERVER_AUTH not in list(eku)  # clients only dial
    assert stat.S_IMODE(os.stat(tmp_path / "ca.key").st_mode) == 0o600


def test_second_run_keeps_the_ca_and_reissues(tmp_path: Path) -> None:
    first = make_dev_certs(tmp_path, ["router"])[0]
    ca_before = (tmp_path / "ca.pem").read_bytes()
    cert_before = first.cert_path.read_bytes()
    second = make_dev_certs(tmp_path, ["router", "worker"])
    assert (tmp_path / "ca.pem").read_bytes() == ca_before
    assert second[0].cert_path.read_bytes() != cert_before
    _load(second[1].cert_path).verify_directly_issued_by(_load(tmp_path / "ca.pem"))


def test_cli_writes_the_requested_certificates(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["certs", str(tmp_path / "tls"), "--services", "router,worker",
                 "--clients", "ops", "--hosts", "10.9.8.7"])
    assert code == 0
    names = sorted(p.name for p in (tmp_path / "tls").iterdir())
    assert names == ["ca.key", "ca.pem", "ops.key", "ops.pem", "router.key", "router.pem",
                     "worker.key", "worker.pem"]
    assert "client   ops" in capsys.readouterr().out
    _, ips, _ = _sans(_load(tmp_path / "tls" / "worker.pem"))
    assert ipaddress.ip_address("10.9.8.7") in {ipaddress.ip_address(i) for i in ips}
    assert main(["certs", str(tmp_path / "bad"), "--services", "../escape"]) == 2


def test_spiffe_ids_and_kinds() -> None:
    assert parse_spiffe_id("spiffe://pdserve.local/worker/p-1") == (PeerKind.WORKER, "p-1")
    assert parse_spiffe_id("spiffe://pdserve.local/service/router") == (PeerKind.SERVICE, "router")
    for other in ("spiffe://evil.example/worker/x", "spiffe://pdserve.local/root/x",
                  "spiffe://pdserve.local/worker/", "spiffe://pdserve.local/worker", ""):
        assert parse_spiffe_id(other) is None, other
    assert kind_for_name("worker-3") is PeerKind.WORKER
    assert kind_for_name("kv-transfer") is PeerKind.SERVICE
    assert kind_for_name("someone") is PeerKind.CLIENT


def test_reloading_credentials_take_a_valid_pair_and_ignore_a_broken_one(tmp_path: Path) -> None:
    ca = CertificateAuthority.create(tmp_path)
    cert = ca.issue(tmp_path, "router")
    now = [0.0]
    reloading = ReloadingServerCredentials(cert.tls(ca.cert_path), poll_interval_s=1.0,
                                           clock=lambda: now[0])
    assert isinstance(reloading.credentials(), grpc.ServerCredentials)
    now[0] = 5.0
    assert reloading.fetch() is None  # nothing changed

    # A renewal caught half-way (new key, old certificate): refused, the old pair stays.
    old_cert = cert.cert_path.read_bytes()
    ca.issue(tmp_path, "router")
    new_cert = cert.cert_path.read_bytes()
    cert.cert_path.write_bytes(old_cert)
    now[0] = 10.0
    assert reloading.fetch() is None and reloading.num_reloads == 0

    cert.cert_path.write_bytes(new_cert)
    now[0] = 10.5
    assert reloading.fetch() is None  # within the poll interval: not even looked at
    now[0] = 11.0
    assert isinstance(reloading.fetch(), grpc.ServerCertificateConfiguration)
    assert reloading.num_reloads == 1
