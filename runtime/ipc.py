"""Sockets, the wire codec and the addresses the processes talk over.

One msgpack encoder for everything and one decoder per conversation (runtime/messages.py):
a message that does not decode raises `BadMessage`, which every receiving loop turns into
an error reply or a log line, never into a dead process.

Internal sockets are PUSH/PULL pairs over ipc:// paths in a private directory: each process
binds the sockets it receives on and connects the ones it sends on, so start order does
not matter (ZeroMQ queues messages until the peer connects).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from runtime import messages as m

encoder = msgspec.msgpack.Encoder()


class BadMessage(ValueError):
    """Bytes that are not a valid message of the conversation they arrived on."""


class Decoder:
    def __init__(self, union: Any):
        self._decoder = msgspec.msgpack.Decoder(union)

    def __call__(self, data: bytes):
        try:
            return self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as e:
            raise BadMessage(str(e)) from None


decode_client_request = Decoder(m.ClientRequest)
decode_client_reply = Decoder(m.ClientReply)
decode_to_scheduler = Decoder(m.ToScheduler)
decode_to_tokenizer = Decoder(m.ToTokenizer)
decode_to_executor = Decoder(m.ToExecutor)
decode_to_daemon = Decoder(m.ToDaemon)


def encode(msg: msgspec.Struct) -> bytes:
    return encoder.encode(msg)


@dataclass(frozen=True)
class Addresses:
    """Where every process listens. Clients connect to `clients`; the rest are internal."""

    clients: str  # ROUTER of the tokenizer process (tcp://127.0.0.1:PORT by default)
    tokenizer: str  # PULL: from the scheduler (and the daemon)
    scheduler: str  # PULL: from the tokenizer and the executor
    executor: str  # PULL: from the scheduler
    daemon: str  # PULL: readiness and fatal errors of the children

    @classmethod
    def private(cls, clients: str) -> tuple["Addresses", str]:
        """Internal ipc:// endpoints in a fresh directory (returned, for removal at shutdown)."""
        root = tempfile.mkdtemp(prefix="overlap-")
        os.chmod(root, 0o700)  # only this user may talk to the internal sockets

        def at(name: str) -> str:
            return f"ipc://{root}/{name}"

        return cls(clients, at("tokenizer"), at("scheduler"), at("executor"), at("daemon")), root


def remove_private(root: str) -> None:
    shutil.rmtree(root, ignore_errors=True)


def pull(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    return sock


def push(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    # Do not keep a closing process alive for undelivered messages to a dead peer.
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(address)
    return sock


# -- listen addresses: checked before anything loads -----------------------------------------

class AddressInUse(ConnectionError):
    """A listen address something else already holds (or that cannot be bound at all)."""


def check_listen(addresses: dict[str, str]) -> None:
    """Raise AddressInUse naming the first address (flag → ZeroMQ `tcp://HOST:PORT` /
    `ipc://PATH`, or a websocket/HTTP `HOST:PORT`) that cannot be bound now.

    A probe, not a reservation: the server binds for real moments later, so a race with
    another program remains possible (the bind error then ends startup instead). Port 0 or
    `*` (any free port) always passes.
    """
    for flag, address in addresses.items():
        if address.startswith("ipc://"):
            problem = _ipc_in_use(address[len("ipc://"):])
        elif address.startswith("tcp://"):
            host, port = _split_host_port(address[len("tcp://"):])
            problem = _tcp_unbindable("0.0.0.0" if host == "*" else host, port)
        elif "://" in address:
            continue  # other transports (inproc, ...): ZeroMQ reports them itself
        else:
            host, port = _split_host_port(address)
            problem = _tcp_unbindable(host, port)
        if problem:
            raise AddressInUse(f"cannot listen on {address} ({flag}): {problem}")


def _split_host_port(text: str) -> tuple[str, str]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), port


def _tcp_unbindable(host: str, port: str) -> str | None:
    import socket

    if port in ("*", "0", ""):
        return None
    try:
        infos = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, ValueError) as e:
        return f"bad address: {e}"
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as sock:
            # As ZeroMQ and asyncio bind: SO_REUSEADDR, so TIME_WAIT leftovers do not count.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(sockaddr)
            except OSError as e:
                return e.strerror or str(e)
    return None


def _ipc_in_use(path: str) -> str | None:
    """ZeroMQ would silently take over a path another server listens on: refuse instead."""
    import socket

    if not os.path.exists(path):
        return None
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(path)
        except OSError:
            return None  # a stale socket file: binding replaces it
    return "another process is listening there"
