"""Certificates: a development CA and the certificates it signs, read back as peer identities,
and server credentials that pick up renewed files without a restart.

Identity. Every certificate ``pdserve certs`` makes carries, beside its DNS/IP names, one URI
subject-alternative name ``spiffe://pdserve.local/<kind>/<name>`` (the SPIFFE ID form, which
gRPC reports as the peer's ``peer_spiffe_id``). ``kind`` is what the authorization table in
``pdserve.common.auth`` keys on:

==========  =======================================================================
``service``  a control-plane process (router, pool managers, coordinator, governor, ``up``)
``worker``   a worker agent
``client``   a client or an operator tool; it still needs an API or admin key per call
==========  =======================================================================

A peer certificate signed by the configured CA but without such a URI is treated as ``client``:
the certificate then only proves the connection may be made, never what the caller may do.

Reload. ``ReloadingServerCredentials`` backs ``grpc.dynamic_ssl_server_credentials``: gRPC asks
it for the current key pair and client CA at new handshakes, and it re-reads the PEM files when
their modification time, size or inode changed (checked at most every ``poll_interval_s``).
Established connections keep the certificate they were opened with; new ones get the new one.
A half-written or mismatched pair is ignored (the previous pair stays, a warning is logged), so
renewal can write the two files in any order.

Generating needs the ``cryptography`` package (imported lazily); reading and reloading do not.
"""

from __future__ import annotations

import datetime as dt
import enum
import ipaddress
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import grpc

from pdserve.common.settings import TlsConfig

logger = logging.getLogger(__name__)

TRUST_DOMAIN = "pdserve.local"
SPIFFE_PREFIX = f"spiffe://{TRUST_DOMAIN}/"
CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca.key"
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")
CONTROL_PLANE_NAMES = frozenset(
    {"router", "prefill-pool", "decode-pool", "kv-transfer", "governor", "up", "pdserve-up"}
)


class PeerKind(enum.StrEnum):
    """What a certificate says its holder is (the ``<kind>`` of its SPIFFE ID)."""

    SERVICE = "service"
    WORKER = "worker"
    CLIENT = "client"


def spiffe_id(kind: PeerKind, name: str) -> str:
    return f"{SPIFFE_PREFIX}{kind.value}/{name}"


def parse_spiffe_id(text: str) -> tuple[PeerKind, str] | None:
    """``(kind, name)`` of a pdserve SPIFFE ID; None for anything else (other trust domains,
    unknown kinds, malformed text)."""
    if not text.startswith(SPIFFE_PREFIX):
        return None
    kind_text, sep, name = text[len(SPIFFE_PREFIX):].partition("/")
    if not sep or not name:
        return None
    try:
        return PeerKind(kind_text), name
    except ValueError:
        return None


def kind_for_name(name: str) -> PeerKind:
    """Default kind of a certificate by its name: ``worker*`` -> worker, a control-plane
    service name -> service, anything else -> client."""
    if name.startswith("worker"):
        return PeerKind.WORKER
    if name in CONTROL_PLANE_NAMES:
        return PeerKind.SERVICE
    return PeerKind.CLIENT


# ------------------------------------------------------------------------------- generation


@dataclass(frozen=True, slots=True)
class IssuedCert:
    """Files of one issued certificate (PEM)."""

    name: str
    kind: PeerKind
    cert_path: Path
    key_path: Path

    def tls(self, ca_path: Path) -> TlsConfig:
        """The ``TlsConfig`` a process holding this certificate uses."""
        return TlsConfig(cert_path=self.cert_path, key_path=self.key_path, ca_path=ca_path)


def _crypto() -> tuple[Any, ...]:
    """``x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID`` of ``cryptography``,
    imported on first use so that servers that only read certificates never load it."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from pdserve.common.errors import ConfigError

        raise ConfigError(
            "making certificates needs the 'cryptography' package (pip install cryptography)"
        ) from exc
    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def _write_private(path: Path, data: bytes) -> None:
    """Write a private key readable by its owner only (created 0600, never world-readable)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    os.replace(tmp, path)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _san_entries(hosts: Iterable[str], uri: str) -> list[object]:
    """Subject alternative names: each distinct host as an IP address or DNS name, then ``uri``."""
    x509 = _crypto()[0]
    entries: list[object] = []
    seen: set[str] = set()
    for host in hosts:
        host = host.strip().strip("[]")
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    entries.append(x509.UniformResourceIdentifier(uri))
    return entries


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    """A CA's PEM files; ``issue`` signs new certificates with it."""

    cert_path: Path
    key_path: Path

    @staticmethod
    def create(directory: Path, *, common_name: str = "pdserve development CA",
               valid_days: int = 3650, now: dt.datetime | None = None) -> CertificateAuthority:
        """A new self-signed CA (ECDSA P-256) written to ``directory/ca.pem`` and ``ca.key``."""
        x509, hashes, serialization, ec, _, name_oid = _crypto()
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        now = now or dt.datetime.now(dt.UTC)
        subject = x509.Name([x509.NameAttribute(name_oid.COMMON_NAME, common_name)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                              content_commitment=False, key_encipherment=False,
                              data_encipherment=False, key_agreement=False,
                              encipher_only=False, decipher_only=False),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .sign(key, hashes.SHA256())
        )
        ca = CertificateAuthority(directory / CA_CERT_FILE, directory / CA_KEY_FILE)
        _write_private(ca.key_path, key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        _write_public(ca.cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return ca

    @staticmethod
    def load_or_create(directory: Path) -> CertificateAuthority:
        """The CA in ``directory`` if both files are there, else a new one."""
        ca = CertificateAuthority(directory / CA_CERT_FILE, directory / CA_KEY_FILE)
        if ca.cert_path.exists() and ca.key_path.exists():
            return ca
        return CertificateAuthority.create(directory)

    def issue(self, directory: Path, name: str, *, kind: PeerKind | None = None,
              hosts: Sequence[str] = (), valid_days: int = 365,
              now: dt.datetime | None = None) -> IssuedCert:
        """Sign a certificate for ``name`` into ``directory/<name>.pem`` and ``<name>.key``.

        Subject alternative names: ``localhost``, ``127.0.0.1``, ``::1``, ``name`` itself (the
        host name a container network gives a service), ``hosts``, and the SPIFFE ID of
        ``kind`` (default ``kind_for_name(name)``). Service and worker certificates serve and
        dial (server and client auth); client certificates only dial.
        """
        x509, hashes, serialization, ec, eku_oid, name_oid = _crypto()
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"certificate name {name!r}: expected a plain file name")
        kind = kind or kind_for_name(name)
        ca_key = serialization.load_pem_private_key(self.key_path.read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate(self.cert_path.read_bytes())
        key = ec.generate_private_key(ec.SECP256R1())
        now = now or dt.datetime.now(dt.UTC)
        usages = [eku_oid.CLIENT_AUTH]
        if kind is not PeerKind.CLIENT:
            usages.insert(0, eku_oid.SERVER_AUTH)
        sans = _san_entries([*DEFAULT_HOSTS, name, *hosts], spiffe_id(kind, name))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(name_oid.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=valid_days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                           critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        directory.mkdir(parents=True, exist_ok=True)
        issued = IssuedCert(name, kind, directory / f"{name}.pem", directory / f"{name}.key")
        # Key first: a reloading server that sees the new certificate before its key would
        # refuse the mismatched pair and keep the old one, never serve a broken pair.
        _write_private(issued.key_path, key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        _write_public(issued.cert_path, cert.public_bytes(serialization.Encoding.PEM))
        return issued


def make_dev_certs(directory: Path, names: Sequence[str], *, hosts: Sequence[str] = (),
                   client_names: Sequence[str] = (), valid_days: int = 365) -> list[IssuedCert]:
    """A development CA in ``directory`` (kept if present) and one certificate per name:
    ``names`` by ``kind_for_name``, ``client_names`` always as clients."""
    ca = CertificateAuthority.load_or_create(directory)
    issued = [ca.issue(directory, name, hosts=hosts, valid_days=valid_days) for name in names]
    issued += [ca.issue(directory, name, kind=PeerKind.CLIENT, valid_days=valid_days)
               for name in client_names]
    return issued


# ----------------------------------------------------------------------------- reloading


def _file_stamp(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_mtime_ns, st.st_size, st.st_ino


def _check_key_pair(cert_path: Path, key_path: Path) -> None:
    """Raise ``ValueError`` unless the private key belongs to the certificate (``ssl`` refuses
    a mismatched pair; no extra package needed)."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert_path, key_path)
    except ssl.SSLError as exc:
        raise ValueError(f"{key_path} does not match {cert_path}: {exc.reason}") from None


class ReloadingServerCredentials:
    """Server TLS whose files may be replaced while it serves (``grpc`` dynamic credentials).

    ``credentials()`` returns the ``grpc.ServerCredentials`` to bind with; gRPC calls the fetcher
    from its own threads, hence the lock. ``clock`` is monotonic seconds (injected in tests).
    """

    def __init__(self, tls: TlsConfig, *, poll_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if tls.cert_path is None or tls.key_path is None:
            raise ValueError("a TLS server needs both cert_path and key_path")
        self._tls = tls
        self._paths = [p for p in (tls.cert_path, tls.key_path, tls.ca_path) if p is not None]
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._stamps = self._read_stamps()
        self._next_check_s = clock() + poll_interval_s
        self._initial = self._configuration()
        self.num_reloads = 0

    @property
    def is_mutual(self) -> bool:
        return self._tls.ca_path is not None

    def _read_stamps(self) -> list[tuple[int, int, int]]:
        return [_file_stamp(path) for path in self._paths]

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        assert self._tls.cert_path is not None and self._tls.key_path is not None
        key_pem = self._tls.key_path.read_bytes()
        cert_pem = self._tls.cert_path.read_bytes()
        _check_key_pair(self._tls.cert_path, self._tls.key_path)
        ca_pem = self._tls.ca_path.read_bytes() if self._tls.ca_path else None
        return grpc.ssl_server_certificate_configuration([(key_pem, cert_pem)], ca_pem)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's fetcher: a new configuration when the files changed, else None (keep)."""
        with self._lock:
            now = self._clock()
            if now < self._next_check_s:
                return None
            self._next_check_s = now + self._poll_interval_s
            try:
                stamps = self._read_stamps()
                if stamps == self._stamps:
                    return None
                configuration = self._configuration()
            except (OSError, ValueError) as exc:
                logger.warning("TLS files changed but cannot be loaded (keeping the old ones): %s",
                               exc)
                return None
            self._stamps = stamps
            self.num_reloads += 1
            logger.info("TLS certificate reloaded from %s", self._tls.cert_path)
            return configuration

    def credentials(self) -> grpc.ServerCredentials:
        # gRPC takes None from the fetch callback as "keep the current pair"; its stubs say the
        # callback always returns a configuration.
        fetch = cast(Callable[[], grpc.ServerCertificateConfiguration], self.fetch)
        return grpc.dynamic_ssl_server_credentials(
            self._initial, fetch, require_client_authentication=self.is_mutual)
