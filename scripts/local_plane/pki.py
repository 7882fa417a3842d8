"""The plane's PKI: its CA, serving and client certificates, the kubeconfig, self-signed certificates for tests."""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from local_plane.settings import KUBECONFIG, PKI_DIR, SERVICE_IP

# --------------------------------------------------------------------------------------
# PKI
# --------------------------------------------------------------------------------------


def _pem_cert(cert: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return cert.public_bytes(serialization.Encoding.PEM)


def _pem_key(key: Any, pkcs1: bool = False) -> bytes:
    from cryptography.hazmat.primitives import serialization

    fmt = (
        serialization.PrivateFormat.TraditionalOpenSSL
        if pkcs1
        else serialization.PrivateFormat.PKCS8
    )
    return key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())


@dataclass
class CA:
    cert_pem: bytes
    key_pem: bytes

    @classmethod
    def create(
        cls,
        common_name: str = "posttrain-control-plane-ca",
        hosts: Sequence[str] = (),
        rsa_pkcs1: bool = False,
    ) -> CA:
        """A self-signed CA (EC P-256; RSA-2048 with a PKCS#1 key if `rsa_pkcs1`), valid
        for `hosts` (IP addresses or DNS names) too."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        if rsa_pkcs1:
            from cryptography.hazmat.primitives.asymmetric import rsa

            key: Any = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        else:
            key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = _dt.datetime.now(_dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(hours=1))
            .not_valid_after(now + _dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        )
        if hosts:
            cert = cert.add_extension(_subject_alt_names(hosts), critical=False)
        cert = (
            cert.add_extension(
                _key_usage(ca=True),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        return cls(_pem_cert(cert), _pem_key(key, pkcs1=rsa_pkcs1))

    @classmethod
    def load(cls, directory: Path, name: str = "ca") -> CA:
        return cls(
            (directory / f"{name}.crt").read_bytes(), (directory / f"{name}.key").read_bytes()
        )

    def save(self, directory: Path, name: str = "ca") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / f"{name}.crt").write_bytes(self.cert_pem)
        _write_private(directory / f"{name}.key", self.key_pem)

    def issue(
        self,
        common_name: str,
        *,
        organizations: Sequence[str] = (),
        hosts: Sequence[str] = (),
        server: bool = False,
        client: bool = False,
    ) -> tuple[bytes, bytes]:
        """Issue a leaf certificate; returns (cert_pem, key_pem)."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        ca_cert = x509.load_pem_x509_certificate(self.cert_pem)
        ca_key = serialization.load_pem_private_key(self.key_pem, password=None)
        key = ec.generate_private_key(ec.SECP256R1())
        attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organizations]
        attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
        now = _dt.datetime.now(_dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name(attrs))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _dt.timedelta(hours=1))
            .not_valid_after(now + _dt.timedelta(days=3650))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                _key_usage(ca=False),
                critical=True,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),
                critical=False,
            )
        )
        usages = []
        if server:
            usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
        if client:
            usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
        if usages:
            builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        if hosts:
            builder = builder.add_extension(_subject_alt_names(hosts), critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return _pem_cert(cert), _pem_key(key)


def _key_usage(ca: bool) -> Any:
    """A CA's key usage (signs certificates and CRLs) or a leaf's (signs, enciphers keys)."""
    from cryptography import x509

    unused = "content_commitment data_encipherment key_agreement encipher_only decipher_only"
    return x509.KeyUsage(
        digital_signature=True,
        key_encipherment=not ca,
        key_cert_sign=ca,
        crl_sign=ca,
        **dict.fromkeys(unused.split(), False),
    )


def _subject_alt_names(hosts: Sequence[str]) -> Any:
    """The SubjectAlternativeName extension of `hosts`: IP addresses and DNS names."""
    import ipaddress

    from cryptography import x509

    sans: list[x509.GeneralName] = []
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(sans)


def self_signed(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """`directory`/tls.crt and tls.key: a serving certificate for `host` that is its own
    CA (the `caBundle` of a webhook configuration pointing at it is tls.crt)."""
    ca = CA.create(host, hosts=[host])
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(ca.cert_pem)
    _write_private(key_path, ca.key_pem)
    return cert_path, key_path


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def serving_cert(directory: Path, hosts: Sequence[str] = ("127.0.0.1", "localhost")) -> bytes:
    """Write tls.crt/tls.key (signed by the control-plane CA) to `directory`.

    For webhook servers run outside the cluster (the posttrain operator, JobSet, Kueue).
    Returns the CA bundle (PEM) to put in the webhook configuration's `caBundle`.
    """
    ca = CA.load(PKI_DIR)
    cert, key = ca.issue(hosts[0], hosts=hosts, server=True)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tls.crt").write_bytes(cert)
    _write_private(directory / "tls.key", key)
    (directory / "ca.crt").write_bytes(ca.cert_pem)
    return ca.cert_pem


def _create_pki() -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    if PKI_DIR.exists():
        shutil.rmtree(PKI_DIR)
    ca = CA.create()
    ca.save(PKI_DIR)
    hosts = [
        "127.0.0.1",
        "localhost",
        SERVICE_IP,
        "kubernetes",
        "kubernetes.default",
        "kubernetes.default.svc",
        "kubernetes.default.svc.cluster.local",
    ]
    cert, key = ca.issue("kube-apiserver", hosts=hosts, server=True)
    (PKI_DIR / "apiserver.crt").write_bytes(cert)
    _write_private(PKI_DIR / "apiserver.key", key)
    cert, key = ca.issue("kubernetes-admin", organizations=["system:masters"], client=True)
    (PKI_DIR / "admin.crt").write_bytes(cert)
    _write_private(PKI_DIR / "admin.key", key)
    sa = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    _write_private(PKI_DIR / "sa.key", _pem_key(sa))
    (PKI_DIR / "sa.pub").write_bytes(
        sa.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


def _write_kubeconfig(apiserver_port: int) -> None:
    import base64

    def b64(p: str) -> str:
        return base64.b64encode((PKI_DIR / p).read_bytes()).decode()

    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "posttrain-local",
                "cluster": {
                    "server": f"https://127.0.0.1:{apiserver_port}",
                    "certificate-authority-data": b64("ca.crt"),
                },
            }
        ],
        "users": [
            {
                "name": "admin",
                "user": {
                    "client-certificate-data": b64("admin.crt"),
                    "client-key-data": b64("admin.key"),
                },
            }
        ],
        "contexts": [
            {"name": "posttrain-local", "context": {"cluster": "posttrain-local", "user": "admin"}}
        ],
        "current-context": "posttrain-local",
    }
    tmp = KUBECONFIG.with_suffix(".tmp")
    _write_private(tmp, json.dumps(cfg, indent=2).encode())
    tmp.replace(KUBECONFIG)
