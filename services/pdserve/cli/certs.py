"""``pdserve certs DIR``: a development CA and certificates for mutual TLS between services.

::

    pdserve certs ./tls --services router,prefill-pool,decode-pool,kv-transfer,governor,worker \\
        --clients operator --hosts pdserve.internal,10.0.0.7

writes ``ca.pem``/``ca.key`` (kept if already there, so more certificates can be added later)
and ``<name>.pem``/``<name>.key`` per name. Every certificate names ``localhost``,
``127.0.0.1``, ``::1``, its own name (a container's host name) and ``--hosts``, and carries the
SPIFFE ID that tells the authorization table what it is (``pdserve.common.certs``): ``worker*``
names are workers, control-plane service names are services, ``--clients`` are clients.
Private keys are written 0600. For development and tests: production certificates come from the
organisation's CA, with the same SPIFFE IDs.
"""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_SERVICES = "router,prefill-pool,decode-pool,kv-transfer,governor,up,worker"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, help="where to write the PEM files")
    parser.add_argument("--services", default=DEFAULT_SERVICES,
                        help=f"comma-separated certificate names [default {DEFAULT_SERVICES}]")
    parser.add_argument("--clients", default="client",
                        help="comma-separated names of client certificates [default client]")
    parser.add_argument("--hosts", default="",
                        help="extra DNS names or IP addresses for every certificate")
    parser.add_argument("--valid-days", type=int, default=365,
                        help="validity of the issued certificates in days [default 365]")


def _names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def run(args: argparse.Namespace) -> int:
    from pdserve.common.certs import make_dev_certs
    from pdserve.common.errors import ConfigError

    if args.valid_days < 1:
        raise ConfigError(f"--valid-days: expected >= 1, got {args.valid_days}")
    try:
        issued = make_dev_certs(args.directory, _names(args.services), hosts=_names(args.hosts),
                                client_names=_names(args.clients), valid_days=args.valid_days)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    print(f"CA {args.directory / 'ca.pem'}")
    for cert in issued:
        print(f"{cert.kind.value:8} {cert.name}: {cert.cert_path} {cert.key_path}")
    return 0
