"""Which attention backend runs where, and the torch-only backend that CUDA falls back to.

`make_backend("reference", "cuda")` used to return the CPU reference backend, whose CPU
index tensors fail the first KV write on a GPU. The device is faked here: the torch backend
is built for "cuda" (nothing is allocated until a plan) and planned on the meta device,
where every tensor it builds must land; FlashInfer's absence or a wrong version is faked
through sys.modules."""

import random
import subprocess
import sys
import types

import pytest
import torch

from attention_oracle import KINDS, max_abs_error, random_paged_batch, random_specs
from helpers import flashinfer_on_fakes
from overlap.attention import ReferenceBackend, SeqAttention, make_backend
from overlap.attention.torch_paged import TorchBackend


def test_reference_on_cuda_is_the_device_side_torch_backend():
    backend = make_backend("reference", "cuda")
    assert isinstance(backend, TorchBackend) and backend.device.type == "cuda"
    assert type(make_backend("reference", "cpu")) is ReferenceBackend
    assert isinstance(make_backend("torch", "cuda:1"), TorchBackend)
    assert make_backend("auto", "cpu").name == "cpu"  # the CPU default stays the compiled kernel


def test_every_tensor_the_torch_backend_plans_is_on_its_device():
    backend = make_backend("torch", "meta")  # a fake device: a CPU tensor would show as cpu
    seqs = [SeqAttention(1, 9, [3]), SeqAttention(20, 40, [0, 1, 2]),
            SeqAttention(3, 7, [4], torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool))]
    meta = backend.plan(seqs, 16, 4, 2, 16, torch.bfloat16)
    tensors = [meta.slots] + [getattr(g, f) for g in meta.groups for f in ("q_index", "dest", "kv_slots", "mask")]
    assert len(meta.groups) == 2 and all(t.device.type == "meta" for t in tensors)


@pytest.mark.parametrize("missing", [True, False])
def test_auto_on_cuda_falls_back_to_torch_without_a_usable_flashinfer(monkeypatch, caplog, missing):
    monkeypatch.delitem(sys.modules, "overlap.attention.flashinfer", raising=False)
    if missing:
        monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    else:
        fake = types.ModuleType("flashinfer")
        fake.__version__ = "0.2.5"
        monkeypatch.setitem(sys.modules, "flashinfer", fake)
    with caplog.at_level("WARNING", logger="overlap.attention"):
        backend = make_backend("auto", "cuda")
    assert isinstance(backend, TorchBackend) and backend.device.type == "cuda"
    message = caplog.records[-1].getMessage()
    assert "torch-only backend" in message
    assert ("not importable" in message or "flashinfer" in message) if missing else "0.2.5 is installed" in message
    if not missing:
        with pytest.raises(ImportError, match=r"flashinfer-python>=0\.7\.4,<0\.8\.0"):
            make_backend("flashinfer", "cuda")


def test_flashinfer_version_range(monkeypatch):
    module = flashinfer_on_fakes(monkeypatch, object, object, "_flashinfer_version_check")
    for ok in ("0.7.4", "0.7.10", "0.7.4.post1", "0.7.5+cu128"):
        assert module.check_flashinfer_version(ok) == ok
    for bad in ("0.2.5", "0.6.18", "0.7.3", "0.8.0", "1.0.0", "unknown"):
        with pytest.raises(RuntimeError, match="checked against"):
            module.check_flashinfer_version(bad)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("page_size", [1, 16, 5])
def test_torch_backend_matches_the_oracle_and_the_reference_bit_for_bit(kind, page_size):
    specs = random_specs(kind, random.Random(page_size))
    batch = random_paged_batch(specs, page_size, dtype=torch.bfloat16, seed=page_size)
    backend = TorchBackend("cpu")
    out = backend.run(batch.layer, batch.q, batch.pool, batch.plan(backend))
    ref = ReferenceBackend().run(batch.layer, batch.q, batch.pool, batch.plan(ReferenceBackend()))
    assert torch.equal(out, ref)
    assert max_abs_error(out, batch.expected) < 2e-2


def test_the_cpu_path_imports_no_cuda_only_module():
    code = ("import sys; from overlap.attention import make_backend; import overlap.executor, overlap.graphs; "
            "make_backend('auto', 'cpu'); make_backend('reference', 'cpu'); "
            "bad = [m for m in ('flashinfer', 'overlap.attention.flashinfer') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
