"""The wire: every message round-trips through the one codec; bad bytes become BadMessage."""

import msgspec
import pytest

from overlap.batch import BatchPlan, SeqOutput, SeqWork, StepOutput
from runtime import ipc
from runtime import messages as m

PLAN = BatchPlan(7, [SeqWork(3, [1, 2, 3], 0, [4, 5], True, 0.5, 10, 0.9, 123, 2, True)], [9])
OUTPUT = StepOutput(7, [SeqOutput(3, [4, 5], 2, 1)])

CONVERSATIONS = {
    ipc.decode_client_request: [
        m.Generate("r1", prompt="hi", params=m.SamplingParams(max_tokens=3, stop=["\n"], seed=1)),
        m.Generate("r2", messages=[m.ChatMessage("user", "hello")]),
        m.Generate("r3", prompt_token_ids=m.pack_ids([1, 49151, 0])),
        m.Abort("r1"), m.Health("q"), m.Stats("q2"),
    ],
    ipc.decode_client_reply: [
        m.Delta("r1", "text", [1, 2]), m.Delta("r1", "", [], "stop", {"output_tokens": 2}),
        m.Error("r1", "bad", field="max_tokens"), m.Error("", "malformed", code="internal"),
        m.HealthReply("q", True, "model", "draft", 1.5), m.StatsReply("q2", {"waiting": 0}),
    ],
    ipc.decode_to_scheduler: [
        m.AddRequest("x", m.pack_ids([5, 6]), m.SamplingParams(), 42, 3), m.AbortRequest("x"),
        m.StatsQuery("q"), m.StepResult(OUTPUT, {"device_busy_s": 1.0}), m.FatalError("executor", "boom"),
    ],
    ipc.decode_to_tokenizer: [
        m.TokenBatch([m.TokenUpdate("x", [1], None), m.TokenUpdate("y", [2, 3], "length", 4, 1)]),
        m.SchedulerStats("q", {"free_pages": 3}), m.RequestFailed("x", "full", "overloaded"),
        m.FatalError("scheduler", "boom"),
    ],
    ipc.decode_to_executor: [m.Execute(PLAN), m.Shutdown()],
    ipc.decode_to_daemon: [m.Ready("executor", 123), m.Ready("tokenizer", 5, "tcp://127.0.0.1:5"),
                           m.FatalError("tokenizer", "x")],
}


@pytest.mark.parametrize("decode,msg", [(d, msg) for d, msgs in CONVERSATIONS.items() for msg in msgs],
                         ids=lambda x: type(x).__name__ if isinstance(x, msgspec.Struct) else "")
def test_round_trip(decode, msg):
    assert decode(ipc.encode(msg)) == msg


def test_every_struct_is_covered():
    sent = {type(msg) for msgs in CONVERSATIONS.values() for msg in msgs}
    defined = {v for v in vars(m).values() if isinstance(v, type) and issubclass(v, msgspec.Struct)
               and v.__module__ == m.__name__} - {m.SamplingParams, m.ChatMessage, m.TokenUpdate}
    assert defined <= sent


def test_packed_ids():
    ids = [0, 1, 2**31 - 1, 49151]
    assert m.unpack_ids(m.pack_ids(ids)) == ids
    assert len(m.pack_ids(ids)) == 16
    with pytest.raises(m.RequestError, match="multiple of 4"):
        m.unpack_ids(b"\x00\x01\x02")


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"not msgpack at all", msgspec.msgpack.encode([1, 2, 3]),
    msgspec.msgpack.encode({"type": "nope"}),
    msgspec.msgpack.encode({"type": "generate"}),  # no request_id
    msgspec.msgpack.encode({"type": "generate", "request_id": 5}),  # wrong type
    msgspec.msgpack.encode({"type": "generate", "request_id": "a", "colour": 1}),  # unknown field
    msgspec.msgpack.encode({"type": "generate", "request_id": "a", "params": {"max_tokens": "x"}}),
])
def test_malformed_bytes_raise_bad_message(data):
    for decode in CONVERSATIONS:
        with pytest.raises(ipc.BadMessage):
            decode(data)


def test_no_pickle_on_the_wire():
    # The codec is msgpack: a Python object it does not know is refused, never pickled.
    with pytest.raises(TypeError):
        ipc.encode(object())
