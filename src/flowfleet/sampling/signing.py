"""Ed25519 keys and signatures for contributed experts (flowfleet keygen, contribute, admit).

A key pair is two files: NAME.key (the private key, PEM PKCS#8, readable by its owner only) and NAME.pub (one line,
`flowfleet-ed25519 BASE64 COMMENT`, the 32 raw bytes of the public key). A key's id is the first 16 hex digits of
the sha256 of those 32 bytes: what a package's manifest, a fleet's card.json and `flowfleet verify` name. A fleet's
owner trusts keys by listing their .pub lines in one file (or keeping .pub files in one folder).

The `cryptography` package does the signing: nothing here is written by hand but the file format.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from flowfleet.errors import FlowfleetError

PUBLIC_PREFIX = "flowfleet-ed25519"


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_line(public: Ed25519PublicKey, comment: str = "") -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return f"{PUBLIC_PREFIX} {base64.b64encode(raw).decode()} {comment}".rstrip() + "\n"


def keygen(out: str | Path, comment: str = "") -> tuple[Path, Path, str]:
    """OUT.key and OUT.pub (refusing to overwrite either); -> (private, public, key id)."""
    private_path, public_path = Path(f"{out}.key"), Path(f"{out}.pub")
    for path in (private_path, public_path):
        if path.exists():
            raise FlowfleetError(f"{path}: exists; keygen never overwrites a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    private_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path.write_text(public_line(key.public_key(), comment or private_path.stem))
    return private_path, public_path, key_id(key.public_key())


def load_private(path: str | Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except (OSError, ValueError, TypeError) as err:
        raise FlowfleetError(f"{path}: not a readable private key ({err})") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise FlowfleetError(f"{path}: not an Ed25519 key (flowfleet keygen makes one)")
    return key


def parse_public(line: str, where: str) -> Ed25519PublicKey:
    parts = line.split()
    if len(parts) < 2 or parts[0] != PUBLIC_PREFIX:
        raise FlowfleetError(f"{where}: not a flowfleet public key line ('{PUBLIC_PREFIX} BASE64 [comment]')")
    try:
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(parts[1], validate=True))
    except ValueError as err:
        raise FlowfleetError(f"{where}: not an Ed25519 public key ({err})") from None


def read_trusted(path: str | Path) -> dict[str, Ed25519PublicKey]:
    """The owner's trusted keys by id: a file of .pub lines (blank lines and # comments skipped), or a folder of
    .pub files."""
    path = Path(path)
    files = sorted(path.glob("*.pub")) if path.is_dir() else [path]
    keys: dict[str, Ed25519PublicKey] = {}
    for file in files:
        try:
            lines = file.read_text().splitlines()
        except OSError as err:
            raise FlowfleetError(f"{file}: cannot read the trusted keys ({err.strerror})") from None
        for i, line in enumerate(lines, 1):
            if line.strip() and not line.lstrip().startswith("#"):
                key = parse_public(line, f"{file}:{i}")
                keys[key_id(key)] = key
    if not keys:
        raise FlowfleetError(f"{path}: no trusted key in it")
    return keys


def sign(key: Ed25519PrivateKey, data: bytes) -> bytes:
    return key.sign(data)


def signed_by(keys: dict[str, Ed25519PublicKey], data: bytes, signature: bytes) -> str | None:
    """The id of the trusted key whose signature over `data` this is, or None."""
    for kid, key in keys.items():
        try:
            key.verify(signature, data)
        except InvalidSignature:
            continue
        return kid
    return None
