"""overlap/config.py: TOML loading (paths relative to the file), device checks."""

import pytest
import torch

from overlap import kernels
from overlap.config import EngineConfig, SpecConfig, check_device, default_tree_tokens, load_config, tree_tokens


def test_relative_paths_are_relative_to_the_config_file(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    path = tmp_path / "a" / "b" / "x.toml"
    path.write_text('model = "models/m"\n[spec]\nmethod = "draft"\ndraft_model = "../drafts/d"\n')
    monkeypatch.chdir(tmp_path)  # not the cwd, not the file's grandparent
    config = load_config(path.relative_to(tmp_path))
    assert config.model == str((tmp_path / "a" / "b" / "models" / "m").resolve())
    assert config.spec.draft_model == str((tmp_path / "a" / "drafts" / "d").resolve())


def test_absolute_and_home_paths_are_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = tmp_path / "x.toml"
    path.write_text(f'model = "{tmp_path / "abs"}"\n[spec]\nmethod = "mtp"\nhead = "~/heads/h"\n')
    config = load_config(path)
    assert config.model == str(tmp_path / "abs")
    assert config.spec.head == str((tmp_path / "home" / "heads" / "h").resolve())


def test_eagle_config_with_a_chain_length_is_an_error(tmp_path):
    path = tmp_path / "e.toml"
    path.write_text('[spec]\nmethod = "eagle"\nnum_spec_tokens = 3\n')
    with pytest.raises(ValueError, match="num_spec_tokens does not apply to method \"eagle\""):
        load_config(path)
    path.write_text('[spec]\nmethod = "eagle"\ntree_depth = 2\n')
    assert load_config(path).spec.tree_depth == 2


def test_device_and_backend_checks():
    check_device("cpu")
    check_device("cpu", "reference")
    for device, backend, needle in [("gpu", "auto", "cpu, cuda or cuda:N"), ("cpu:0", "auto", "cpu, cuda or cuda:N"),
                                    ("cpu", "flashinfer", "needs a CUDA device"), ("cpu", "fast", "auto, cpu, reference, torch")]:
        with pytest.raises(ValueError, match=needle):
            check_device(device, backend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_a_device_says_so():
    with pytest.raises(ValueError, match="no CUDA device is available.*--device cpu"):
        check_device("cuda")


def test_the_tree_size_follows_what_verifies_it(monkeypatch):
    amx = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: amx)
    assert default_tree_tokens("cpu") == 7  # one 16-row AMX tile with the root and an 8-token branch
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")  # the same CPU held to the 6-row tiles
    assert default_tree_tokens("cpu") == 5
    monkeypatch.setattr(kernels, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert default_tree_tokens("cpu") == 5
    assert default_tree_tokens("cuda") == 7
    eagle = EngineConfig(spec=SpecConfig(method="eagle"))
    assert tree_tokens(eagle) == 5
    assert tree_tokens(eagle.replace(spec=SpecConfig(method="eagle", tree_tokens=8))) == 8
    with pytest.raises(ValueError, match="tree_tokens must be at least 1"):
        tree_tokens(eagle.replace(spec=SpecConfig(method="eagle", tree_tokens=0)))
