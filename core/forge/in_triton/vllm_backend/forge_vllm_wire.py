"""The messages between forge's ``vllm`` backend (the python stub) and its vLLM engine process.

Each message is one JSON object behind its length (4 bytes, big-endian) on a Unix socket pair. The stub
sends ``generate`` (an id, the prompt, the ``sampling_parameters`` text, the flags of the request) and
``abort``; the engine answers ``ready`` or ``fatal`` once, then, per request, ``out`` messages (the last
one ``final``) or one ``error``. Shared by both sides, so it needs nothing but the standard library.
"""

from __future__ import annotations

import json
import socket
import struct

HEADER = struct.Struct("!I")


def pack(message: dict) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return HEADER.pack(len(data)) + data


def unpack(data: bytes) -> dict:
    return json.loads(data)


class Reader:
    """The messages of one socket (blocking), read in large pieces: the messages of one engine step arrive
    together and cost one system call."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buffer = bytearray()

    def receive(self) -> dict | None:
        """The next message (blocking), or None once the other side has closed the socket."""
        while True:
            if len(self.buffer) >= HEADER.size:
                end = HEADER.size + HEADER.unpack_from(self.buffer)[0]
                if len(self.buffer) >= end:
                    body = bytes(self.buffer[HEADER.size:end])
                    del self.buffer[:end]
                    return unpack(body)
            try:
                chunk = self.sock.recv(1 << 20)
            except OSError:
                return None
            if not chunk:
                return None
            self.buffer += chunk
