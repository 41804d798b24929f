"""A cache cluster's certificates for tests: a CA, and one certificate it signed for 127.0.0.1
that every loopback node presents."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def cluster_certificates(where: Path) -> dict[str, str]:
    """GPUFEED_PEER_TLS_* for a node at 127.0.0.1, the files written under `where`."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpufeed test cluster CA")])
    ca = (
        x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    node = (
        x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")]))
        .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = {"GPUFEED_PEER_TLS_CA": where / "ca.pem", "GPUFEED_PEER_TLS_CERT": where / "node.pem",
             "GPUFEED_PEER_TLS_KEY": where / "node.key"}
    files["GPUFEED_PEER_TLS_CA"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    files["GPUFEED_PEER_TLS_CERT"].write_bytes(node.public_bytes(serialization.Encoding.PEM))
    files["GPUFEED_PEER_TLS_KEY"].write_bytes(_pem_key(key))
    files["GPUFEED_PEER_TLS_KEY"].chmod(0o600)
    return {name: str(path) for name, path in files.items()}
