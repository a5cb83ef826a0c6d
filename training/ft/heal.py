"""The heal transport: a rejoining region fetches a live peer's state sealed with SM4-GCM.

torchft's default `HTTPTransport` serves the state dict in the clear; this replaces it
(`torchft.checkpointing.CheckpointTransport`, the interface torchft's Manager calls):

- the donor serializes its state once when the Manager asks it to send (`torch.save`);
- the healer asks for it with a fresh 16-byte challenge in the URL; the donor seals the
  bytes for that request alone: key = HKDF(run key, run tag, "heal|step N"), a random
  nonce, and associated data binding run, step and challenge. A response recorded earlier
  (another step, another request, another run key) fails authentication;
- the healer verifies before it parses anything, then loads with `weights_only=True`.

The server listens on the node's own (overlay) address only, on an ephemeral port that the
Manager advertises to the healer through torchft's metadata RPC.
"""

from __future__ import annotations

import io
import os
import threading
import urllib.request
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from torchft.checkpointing import CheckpointTransport

from training.comm.session import derive, run_tag
from training.errors import TransientReject

NONCE_BYTES = 12
TAG_BYTES = 16
CHALLENGE_BYTES = 16


def seal(key: bytes, cipher: str, body: bytes, aad: bytes) -> bytes:
    """nonce || tag || ciphertext (SM4-GCM, or AES-GCM with a 32-byte key)."""
    nonce = os.urandom(NONCE_BYTES)
    enc = _cipher(cipher, key, nonce).encryptor()
    enc.authenticate_additional_data(aad)
    ct = enc.update(body) + enc.finalize()
    return nonce + enc.tag + ct


def unseal(key: bytes, cipher: str, blob: bytes, aad: bytes) -> bytes:
    """The body of `seal`; TransientReject when it does not authenticate."""
    nonce, tag = blob[:NONCE_BYTES], blob[NONCE_BYTES : NONCE_BYTES + TAG_BYTES]
    try:
        dec = _cipher(cipher, key, nonce, tag).decryptor()
        dec.authenticate_additional_data(aad)
        return dec.update(blob[NONCE_BYTES + TAG_BYTES :]) + dec.finalize()
    except (InvalidTag, ValueError):
        raise TransientReject(
            "the heal state from the donor region failed authentication (tampered, "
            "replayed, or another run key); not loaded"
        ) from None


def _cipher(name: str, key: bytes, nonce: bytes, tag: bytes | None = None) -> Cipher[Any]:
    alg = algorithms.SM4(key) if name == "sm4-gcm" else algorithms.AES(key)
    return Cipher(alg, modes.GCM(nonce, tag))


class SealedTransport(CheckpointTransport[dict[str, Any]]):
    """torchft's checkpoint transport, sealed (see the module docstring)."""

    def __init__(self, host: str, run_key: bytes, run_id: str, cipher: str = "sm4-gcm") -> None:
        self._cipher = cipher if cipher != "none" else "sm4-gcm"  # state is always sealed
        self._run_key = run_key
        self._tag = run_tag(run_id)
        self._staged: tuple[int, bytes] | None = None
        self._lock = threading.Condition()
        self.wait_s = 60.0
        """How long a request waits for its step to be staged (a healer may ask first)."""
        self.sent = 0
        """Heals served (responses sealed) by this rank."""
        self._server = ThreadingHTTPServer((host, 0), self._handler())
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        port = self._server.server_address[1]
        self._url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def key(self, step: int) -> bytes:
        return derive(
            self._run_key, self._tag, f"heal|step{step}", 16 if "sm4" in self._cipher else 32
        )

    def aad(self, step: int, challenge: bytes) -> bytes:
        return b"geotrain/heal|" + self._tag + step.to_bytes(8, "big") + challenge

    def metadata(self) -> str:
        return self._url

    def send_checkpoint(
        self, dst_ranks: list[int], step: int, state_dict: dict[str, Any], timeout: timedelta
    ) -> None:
        buf = io.BytesIO()
        torch.save(state_dict, buf)  # a snapshot: training may change the live tensors
        with self._lock:
            self._staged = (step, buf.getvalue())
            self._lock.notify_all()
        self.wait_s = timeout.total_seconds()

    def disallow_checkpoint(self) -> None:
        with self._lock:
            self._staged = None

    def recv_checkpoint(
        self, src_rank: int, metadata: str, step: int, timeout: timedelta
    ) -> dict[str, Any]:
        challenge = os.urandom(CHALLENGE_BYTES)
        url = f"{metadata}/{step}/{challenge.hex()}"
        with urllib.request.urlopen(url, timeout=timeout.total_seconds()) as r:
            blob = r.read()
        body = unseal(self.key(step), self._cipher, blob, self.aad(step, challenge))
        state: dict[str, Any] = torch.load(io.BytesIO(body), weights_only=True)
        return state

    def shutdown(self, wait: bool = True) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _respond(self, path: str) -> bytes | None:
        """The sealed state for GET /<step>/<challenge hex>; None: nothing staged for it."""
        parts = path.strip("/").split("/")
        if len(parts) != 2 or not parts[0].isdigit() or len(parts[1]) != 2 * CHALLENGE_BYTES:
            return None
        step, challenge = int(parts[0]), bytes.fromhex(parts[1])
        with self._lock:  # the healer's quorum may finish before the donor's staged it
            self._lock.wait_for(
                lambda: self._staged is not None and self._staged[0] >= step, self.wait_s
            )
            staged = self._staged
        if staged is None or staged[0] != step:
            return None
        self.sent += 1
        return seal(self.key(step), self._cipher, staged[1], self.aad(step, challenge))

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        transport = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                try:
                    body = transport._respond(self.path)
                except ValueError:
                    body = None
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                return  # no per-request lines on stderr

        return Handler
