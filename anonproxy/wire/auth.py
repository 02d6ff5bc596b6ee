"""Client side of PostgreSQL password authentication, without I/O.

The proxy logs in to the server on its own account (the service connection)
with SCRAM-SHA-256 (RFC 5802 / 7677, no channel binding), md5 or a clear-text
password, whichever the server asks for.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import struct

from .protocol import ProtocolViolation, message

AUTH_OK, AUTH_CLEARTEXT, AUTH_MD5, AUTH_SASL, AUTH_SASL_CONTINUE, AUTH_SASL_FINAL = 0, 3, 5, 10, 11, 12
SCRAM = "SCRAM-SHA-256"


class AuthenticationFailed(Exception):
    pass


class PasswordAuthenticator:
    """Answers the server's Authentication requests for one login.

    ``respond(body)`` takes the body of an 'R' message and returns the bytes
    to send (possibly none); ``done`` turns true on AuthenticationOk.
    """

    def __init__(self, user: str, password: str) -> None:
        self._user = user
        self._password = password
        self._nonce = base64.b64encode(secrets.token_bytes(18)).decode()
        self._client_first_bare = f"n=,r={self._nonce}"
        self._server_signature = b""
        self.done = False

    def respond(self, body: bytes) -> bytes:
        (code,) = struct.unpack_from("!i", body)
        if code == AUTH_OK:
            self.done = True
            return b""
        if code == AUTH_CLEARTEXT:
            return message(b"p", self._password.encode() + b"\0")
        if code == AUTH_MD5:
            return message(b"p", md5_password(self._user, self._password, body[4:8]).encode() + b"\0")
        if code == AUTH_SASL:
            mechanisms = body[4:].split(b"\0")
            if SCRAM.encode() not in mechanisms:
                raise AuthenticationFailed(f"server offers no supported SASL mechanism: {mechanisms}")
            first = ("n,," + self._client_first_bare).encode()
            return message(b"p", SCRAM.encode() + b"\0" + struct.pack("!i", len(first)) + first)
        if code == AUTH_SASL_CONTINUE:
            return message(b"p", self._scram_final(body[4:].decode()))
        if code == AUTH_SASL_FINAL:
            attributes = _attributes(body[4:].decode())
            if not hmac.compare_digest(base64.b64decode(attributes.get("v", "")), self._server_signature):
                raise AuthenticationFailed("the server's SCRAM signature does not match: wrong server?")
            return b""
        raise AuthenticationFailed(f"unsupported authentication request (code {code})")

    def _scram_final(self, server_first: str) -> bytes:
        attributes = _attributes(server_first)
        nonce, salt, iterations = attributes["r"], base64.b64decode(attributes["s"]), int(attributes["i"])
        if not nonce.startswith(self._nonce):
            raise ProtocolViolation("the server's SCRAM nonce does not extend ours")
        salted = hashlib.pbkdf2_hmac("sha256", self._password.encode(), salt, iterations)
        client_key = _hmac(salted, b"Client Key")
        final_without_proof = f"c=biws,r={nonce}"
        auth_message = f"{self._client_first_bare},{server_first},{final_without_proof}".encode()
        signature = _hmac(hashlib.sha256(client_key).digest(), auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature))
        self._server_signature = _hmac(_hmac(salted, b"Server Key"), auth_message)
        return f"{final_without_proof},p={base64.b64encode(proof).decode()}".encode()


def md5_password(user: str, password: str, salt: bytes) -> str:
    inner = hashlib.md5(password.encode() + user.encode()).hexdigest()
    return "md5" + hashlib.md5(inner.encode() + salt).hexdigest()


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def _attributes(text: str) -> dict[str, str]:
    return {item[0]: item[2:] for item in text.split(",") if len(item) >= 2 and item[1] == "="}
