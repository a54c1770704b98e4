"""Test TLS material: one trusted CA and the server certificates the hostile upstream serves.

Built with ``trustme`` so no key ever leaves the test run. Every file is written under the
directory given to :class:`TestPKI`, because the proxy under test is configured by *file
path* (its upstream trust store is ``ca_cert``), not by in-memory objects.
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
from pathlib import Path

import trustme

#: The server certificate kinds, in the order the hostile upstream opens their ports.
TLS_KINDS: tuple[str, ...] = ("good", "untrusted", "expired", "wrong_host")

#: Names every "valid" server certificate carries. Note: OpenSSL refuses to match a
#: wildcard directly under a single-label suffix, so ``*.test`` never matches ``x.test``;
#: use ``api.payments.test`` or ``<label>.example.test`` for hostname-checked tests.
SERVER_NAMES: tuple[str, ...] = (
    "localhost",
    "127.0.0.1",
    "api.payments.test",
    "*.test",
    "*.example.test",
)

#: The only name on the ``wrong_host`` certificate; nothing a test connects to uses it.
WRONG_HOST_NAME = "wrong.invalid-host.test"


class TestPKI:
    """A trusted test CA, a second CA nobody trusts, and four server certificate chains.

    Create once per session: key generation is the slow part. Attributes are file paths
    (``str``): ``ca_cert`` and ``untrusted_ca_cert`` hold a CA certificate (PEM);
    ``good``, ``untrusted``, ``expired`` and ``wrong_host`` each hold a private key plus
    the certificate chain, ready for ``ssl.SSLContext.load_cert_chain(path)``.
    """

    # The class name starts with "Test"; without this pytest tries to collect it
    # wherever a test module imports it.
    __test__ = False

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

        self._ca = trustme.CA(organization_name="Affidavit test CA")
        # A CA with the same shape as the trusted one, so the only difference a client
        # can see is "unknown issuer".
        self._untrusted_ca = trustme.CA(organization_name="Affidavit untrusted CA")

        now = dt.datetime.now(dt.timezone.utc)
        leaves: dict[str, trustme.LeafCert] = {
            "good": self._ca.issue_cert(*SERVER_NAMES),
            "untrusted": self._untrusted_ca.issue_cert(*SERVER_NAMES),
            # Entirely in the past (not merely "expires soon") so clock skew between the
            # test and the proxy cannot make it valid again.
            "expired": self._ca.issue_cert(
                *SERVER_NAMES,
                not_before=now - dt.timedelta(days=30),
                not_after=now - dt.timedelta(days=1),
            ),
            "wrong_host": self._ca.issue_cert(WRONG_HOST_NAME),
        }

        self.ca_cert = self._write("ca.pem", self._ca.cert_pem.bytes())
        self.untrusted_ca_cert = self._write("untrusted-ca.pem", self._untrusted_ca.cert_pem.bytes())
        self._chains: dict[str, str] = {}
        self._certs: dict[str, str] = {}
        self._keys: dict[str, str] = {}
        for kind, leaf in leaves.items():
            chain = b"".join(blob.bytes() for blob in leaf.cert_chain_pems)
            key = leaf.private_key_pem.bytes()
            self._certs[kind] = self._write(f"{kind}.cert.pem", chain)
            self._keys[kind] = self._write(f"{kind}.key.pem", key)
            self._chains[kind] = self._write(f"{kind}.pem", key + chain)

        self.good = self._chains["good"]
        self.untrusted = self._chains["untrusted"]
        self.expired = self._chains["expired"]
        self.wrong_host = self._chains["wrong_host"]

    def _write(self, name: str, data: bytes) -> str:
        path = self.directory / name
        path.write_bytes(data)
        return str(path)

    def chain(self, kind: str) -> str:
        """Path of the key + certificate chain PEM for ``kind`` (one of ``TLS_KINDS``)."""
        return self._chains[self._check(kind)]

    def cert(self, kind: str) -> str:
        """Path of the certificate chain alone, for tools that want cert and key apart."""
        return self._certs[self._check(kind)]

    def key(self, kind: str) -> str:
        """Path of the private key alone."""
        return self._keys[self._check(kind)]

    @staticmethod
    def _check(kind: str) -> str:
        if kind not in TLS_KINDS:
            raise KeyError(f"unknown TLS kind {kind!r}; expected one of {TLS_KINDS}")
        return kind

    def server_context(self, kind: str) -> ssl.SSLContext:
        """A fresh server-side context presenting the ``kind`` certificate.

        Fresh per call so callers may attach their own callbacks (SNI capture) safely.
        ALPN offers only http/1.1: a client that also offers h2 must not be talked into
        HTTP/2, which the hostile upstream does not speak.
        """
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.chain(kind))
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx

    def client_context(self) -> ssl.SSLContext:
        """A verifying client context that trusts only the test CA (not the system store)."""
        return ssl.create_default_context(cafile=self.ca_cert)
