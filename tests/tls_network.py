"""What the upstream TLS tests and benchmark stand on: certificates made with openssl, a network namespace joined to
the host by a veth pair, and a TCP tap that records what a client sends through it.

Run as root (network namespaces); everything made here is removed on exit, also after a failure.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self


@dataclass(frozen=True)
class Certificates:
    directory: Path
    ca: Path  # signs the server's and the client's certificates
    other_ca: Path  # signs nothing here: a CA the server's certificate is unknown to
    server_cert: Path
    server_key: Path
    client_cert: Path  # the proxy's, CN = client_name
    client_key: Path
    revoked: Path  # a CRL of the CA in which the server's certificate is revoked


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(name: str, cwd: Path) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=cwd)


def _signed(name: str, subject: str, extensions: str, cwd: Path) -> None:
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", f"{name}.key", "-out",
             f"{name}.csr", cwd=cwd)
    (cwd / f"{name}.ext").write_text(extensions + "\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=cwd)


def _revoke(name: str, cwd: Path) -> None:
    """A CRL of the CA, ``revoked.crl``, revoking ``name``.crt."""
    (cwd / "ca.cnf").write_text("[ca]\ndefault_ca = test\n[test]\ndatabase = index.txt\ncrlnumber = crlnumber\n"
                                "default_md = sha256\ndefault_crl_days = 2\n")
    (cwd / "index.txt").write_text("")
    (cwd / "crlnumber").write_text("01\n")
    _openssl("ca", "-config", "ca.cnf", "-keyfile", "ca.key", "-cert", "ca.crt", "-revoke", f"{name}.crt", cwd=cwd)
    _openssl("ca", "-config", "ca.cnf", "-keyfile", "ca.key", "-cert", "ca.crt", "-gencrl", "-out", "revoked.crl",
             cwd=cwd)


@contextmanager
def certificates(server_names: list[str], server_addresses: list[str], client_name: str) -> Iterator[Certificates]:
    """A CA, a server certificate for those names and addresses, a client certificate for ``client_name``, a
    CRL revoking the server's certificate, and another CA; in a directory the server's OS account (postgres) can read, removed afterwards."""
    directory = Path(tempfile.mkdtemp(prefix="anonproxy-tls-"))
    try:
        directory.chmod(0o755)
        _ca("ca", directory)
        _ca("other-ca", directory)
        alt = ",".join([*(f"DNS:{name}" for name in server_names), *(f"IP:{address}" for address in server_addresses)])
        _signed("server", f"/CN={server_names[0]}", f"subjectAltName={alt}\nextendedKeyUsage=serverAuth", directory)
        _signed("client", f"/CN={client_name}", "extendedKeyUsage=clientAuth", directory)
        _revoke("server", directory)
        account = pwd.getpwnam("postgres")
        for name in ("server.crt", "server.key", "ca.crt"):  # the server's files: its own, mode 0600 for the key
            os.chown(directory / name, account.pw_uid, account.pw_gid)
        (directory / "server.key").chmod(0o600)
        (directory / "client.key").chmod(0o600)
        yield Certificates(directory, directory / "ca.crt", directory / "other-ca.crt", directory / "server.crt",
                           directory / "server.key", directory / "client.crt", directory / "client.key",
                           directory / "revoked.crl")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Tap:
    """A TCP relay on 127.0.0.1 to ``target``: it passes every byte on and keeps what each client sent first."""

    target: tuple[str, int]
    port: int = 0
    sent: list[bytearray] = field(default_factory=list)  # per connection, the first bytes the client sent
    KEEP = 64

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._client, "127.0.0.1", 0), self._loop)
        self._server = future.result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        kept = bytearray()
        self.sent.append(kept)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer, kept), self._pipe(up_reader, writer, None),
                             return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, kept: bytearray | None) -> None:
        try:
            while data := await reader.read(65536):
                if kept is not None and len(kept) < self.KEEP:
                    kept += data[:self.KEEP - len(kept)]
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()
