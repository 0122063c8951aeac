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
