"""TLS material for the embedded etcd, derived from the job secret: every holder derives the same CA.

Why: the embedded etcd of ``resilient launch`` listens on a loopback TCP port that every
local user can reach, and etcd's password authentication alone did not keep them out:
etcd 3.4 and 3.5 let an anonymous client raise the NOSPACE alarm, and while it is raised
they skip the permission checks of writes, deletes and ``auth disable`` (etcd-io/etcd#22386;
3.6 checks them); anonymous clients may also list, grant and keep alive leases. With
``--client-cert-auth`` etcd refuses, in the TLS handshake, every connection whose client
does not present a certificate signed by its trusted CA: no request of an outsider is ever
parsed. The CA here is derived from the job secret, so nobody without the secret can make a
certificate it signed, and every node, worker and tool that has the secret makes the same
CA from it, with nothing to distribute.

How: HKDF-SHA256 over the secret's key for this purpose (one label per key) gives the
scalar of a P-256 private key (``ec.derive_private_key``): the CA's, the server's, the
client's. The CA certificate is self-signed with a fixed subject, serial and validity, so
its name and key are the same on every node; ECDSA signatures are randomized, so the bytes
of two nodes' certificates differ, which does not matter: a certificate verifies against
any node's copy of the CA (same name, same key). The server certificate names loopback and
the host it serves on, and carries both the serverAuth and clientAuth usages: etcd's JSON
gateway dials its own gRPC server presenting it, and so does the health probe. The client
certificate's common name is no etcd user (``resilient-client``): etcd would take a
certificate's CN as the user when a request carries no token, so it must name nobody.

The files are written (0600, in a 0700 directory not reached through a link) where the
caller says: ``RUN_DIR/control/tls-<fingerprint>`` for a launch, a fresh private temp dir for a tool.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["TlsFiles", "derive_tls", "CLIENT_CN", "SERVER_CN"]

CLIENT_CN = "resilient-client"   # names no etcd user (module doc)
SERVER_CN = "resilient-etcd"
CA_CN = "resilient job CA"
# Fixed, so that every node derives the same CA: valid from before any job, for longer than any.
NOT_BEFORE = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)
NOT_AFTER = datetime.datetime(2124, 1, 1, tzinfo=datetime.timezone.utc)
LABEL = b"resilient-v1/etcd-tls/"


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the PEM files: the CA certificate that both sides trust, the server's
    certificate and key (an embedded etcd), and the client's (everyone who talks to it)."""

    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_conf(self) -> dict[str, str]:
        """The ``--rdzv-conf`` keys of a client that presents the derived certificate."""
        return {"protocol": "https", "ca_cert": str(self.ca), "cert": str(self.client_cert),
                "key": str(self.client_key)}


def _key(root: bytes, name: str):
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    # 48 bytes reduced mod the group order: no measurable bias (RFC 9380 takes the same margin).
    okm = HKDF(algorithm=hashes.SHA256(), length=48, salt=None, info=LABEL + name.encode()).derive(root)
    order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551   # P-256's n
    return ec.derive_private_key(int.from_bytes(okm, "big") % (order - 1) + 1, ec.SECP256R1())


def _name(cn: str | None, unit: str = ""):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, "resilient")]
    if unit:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit))
    if cn:
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
    return x509.Name(attrs)


def _serial(root: bytes, name: str) -> int:
    import hmac

    return int.from_bytes(hmac.digest(root, LABEL + b"serial/" + name.encode(), "sha256")[:16], "big") >> 1


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _certificates(root: bytes, hosts: tuple[str, ...], server: bool) -> dict[str, bytes]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_key, client_key = _key(root, "ca"), _key(root, "client")
    server_key = _key(root, "server") if server else None
    pem = serialization.Encoding.PEM
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (x509.CertificateBuilder().subject_name(_name(CA_CN)).issuer_name(_name(CA_CN))
          .public_key(ca_key.public_key()).serial_number(_serial(root, "ca"))
          .not_valid_before(NOT_BEFORE).not_valid_after(NOT_AFTER)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                       data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                       crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(ca_ski, critical=False)
          .sign(ca_key, hashes.SHA256()))

    def leaf(cn: str, key, usages: list, names: list | None) -> bytes:
        b = (x509.CertificateBuilder().subject_name(_name(None, cn)).issuer_name(_name(CA_CN))
             .public_key(key.public_key()).serial_number(_serial(root, cn))
             .not_valid_before(NOT_BEFORE).not_valid_after(NOT_AFTER)
             .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                          crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
             .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
             .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False))
        if names:
            b = b.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return b.sign(ca_key, hashes.SHA256()).public_bytes(pem)

    sans: list = [x509.DNSName("localhost")]
    for h in dict.fromkeys(("127.0.0.1", "::1", *hosts)):
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    both = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    out = {"ca.pem": ca.public_bytes(pem),
           "client.pem": leaf(CLIENT_CN, client_key, [ExtendedKeyUsageOID.CLIENT_AUTH], None),
           "client.key": _pem_key(client_key)}
    if server:
        out.update({"server.pem": leaf(SERVER_CN, server_key, both, sans), "server.key": _pem_key(server_key)})
    return out


def derive_tls(root: bytes, where: str | os.PathLike | None = None, hosts: tuple[str, ...] = (),
               server: bool = False) -> TlsFiles:
    """Write the CA, server and client PEM files derived from ``root`` (the job secret's key
    for this purpose, :meth:`resilient.secret.JobSecret.key`) into ``where`` (created 0700,
    checked as a private dir: :func:`resilient.rundir.private_dir`), or into a new private
    temp dir removed at exit when None. ``hosts``: the names the server certificate covers
    beyond loopback. ``server``: write the server's files too (the owner of an embedded
    etcd; the others only need the CA and the client's). Each file is written aside and renamed into place, so a reader (an
    agent of the same run dir deriving them at the same time) never sees half of one."""
    from resilient.rundir import private_dir, write_private

    if where is None:
        import atexit

        folder = Path(tempfile.mkdtemp(prefix="resilient-tls-"))   # 0700, a name nobody could guess
        atexit.register(shutil.rmtree, folder, True)
    else:
        folder = private_dir(where, what="TLS dir", narrow=True)
    for name, data in _certificates(root, hosts, server).items():
        write_private(folder / name, data)
    return TlsFiles(folder, folder / "ca.pem", folder / "server.pem", folder / "server.key",
                    folder / "client.pem", folder / "client.key")
