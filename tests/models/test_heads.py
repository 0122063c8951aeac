"""MTP head: paged inference == dense training forward, chains, persistence, KV placement."""

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import hf_model, our_model, tiny_hf_config
from overlap.attention import ReferenceBackend, SeqAttention
from overlap.kv import slot_mapping
from overlap.models.heads import MTPHead, load_head, save_head

PAGE = 4


def tiny_target(hidden=64, vocab=512, dtype=torch.float32, seed=0):
    cfg = tiny_hf_config(vocab=vocab, hidden=hidden, layers=2, heads=4, kv_heads=2)
    return our_model(hf_model(cfg, seed=seed), cfg, dtype)


def random_head(target, norms=True, seed=1, dtype=None):
    head = MTPHead(target.cfg, target, norms=norms, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            # Norm weights off 1 too, so a test notices a norm that is skipped or misplaced.
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + torch.randn(p.shape, generator=gen) * 0.1)
    head.requires_grad_(False)
    return head.eval()


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def target_hidden(target, ids):
    """H [T, hidden] of one sequence (the target's output after its final norm)."""
    kv = target.new_kv_pool(-(-len(ids) // PAGE), PAGE)
    backend = ReferenceBackend()
    meta = backend.plan([SeqAttention(len(ids), len(ids), list(range(kv.num_pages)))], PAGE)
    hidden, _ = target(torch.tensor(ids), torch.arange(len(ids)), backend, kv, meta)
    return hidden


def paged_head(head, tokens, hidden, page_table, start=0, kv=None):
    """Rows start.. of one sequence through the paged inference path; returns (hidden, logits, kv)."""
    n = len(tokens)
    kv = kv or head.new_kv_pool(16, PAGE)
    backend = ReferenceBackend()
    meta = backend.plan([SeqAttention(n, start + n, page_table)], PAGE)
    g, logits = head(torch.as_tensor(tokens), hidden, torch.arange(start, start + n), backend, kv, meta,
                     torch.arange(n))
    return g, logits, kv


@pytest.mark.parametrize("norms", [True, False])
def test_paged_inference_equals_dense_training_forward(target, norms):
    torch.manual_seed(0)
    ids = torch.randint(0, 512, (13,)).tolist()
    hidden = target_hidden(target, ids)
    head = random_head(target, norms)
    # Head row j: token x_{j+1} with H_j at position j.
    tokens, h_in = ids[1:], hidden[:-1]
    g, logits, _ = paged_head(head, tokens, h_in, [3, 7, 1, 9])
    assert g.shape == (12, 64) and logits.shape == (12, 512) and logits.dtype == torch.float32
    with torch.no_grad():
        g_dense, (k, v) = head.forward_dense(torch.tensor([tokens]), h_in[None], torch.arange(12))
        logits_dense = head.dense_logits(g_dense)
    assert k.shape == (1, 12, 2, 16) and v.shape == (1, 12, 2, 16)
    torch.testing.assert_close(g, g_dense[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, logits_dense[0], atol=1e-4, rtol=1e-4)


def test_dense_batch_rows_are_independent(target):
    torch.manual_seed(1)
    head = random_head(target)
    ids = torch.randint(0, 512, (3, 9))
    h = torch.randn(3, 9, 64)
    with torch.no_grad():
        together, _ = head.forward_dense(ids, h, torch.arange(9))
        alone = torch.cat([head.forward_dense(ids[i: i + 1], h[i: i + 1], torch.arange(9))[0] for i in range(3)])
        prefix, _ = head.forward_dense(ids[:, :5], h[:, :5], torch.arange(5))
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(together[:, :5], prefix, atol=1e-5, rtol=1e-5)  # causal


def test_dense_chain_step_equals_paged_chain(target):
    """Step 2 of a chain from every start at once (dense) == a paged chain from one start."""
    torch.manual_seed(2)
    ids = torch.randint(0, 512, (10,)).tolist()
    hidden = target_hidden(target, ids)
    head = random_head(target)
    tokens, h_in = torch.tensor([ids[1:]]), hidden[None, :-1]
    n = tokens.shape[1]
    with torch.no_grad():
        g1, kv1 = head.forward_dense(tokens, h_in, torch.arange(n))
        d1 = head.dense_logits(g1).argmax(-1)
        g2, kv2 = head.forward_dense(d1, g1, torch.arange(1, n + 1), past=[kv1])
        d2 = head.dense_logits(g2).argmax(-1)
        g3, _ = head.forward_dense(d2, g2, torch.arange(2, n + 2), past=[kv1, kv2])
    table = [5, 2, 8, 0]
    for j in (0, 4, 7):
        # Prefill rows 0..j (as the KV-fill would), then chain from row j's outputs.
        g, logits, kv = paged_head(head, ids[1: j + 2], hidden[: j + 1], table)
        torch.testing.assert_close(g[-1], g1[0, j], atol=1e-5, rtol=1e-5)
        d = logits[-1].argmax()
        assert d == d1[0, j]
        gb, logits_b, kv = paged_head(head, [int(d)], g[-1:], table, start=j + 1, kv=kv)
        torch.testing.assert_close(gb[0], g2[0, j], atol=1e-5, rtol=1e-5)
        gc, _, _ = paged_head(head, [int(logits_b[0].argmax())], gb, table, start=j + 2, kv=kv)
        torch.testing.assert_close(gc[0], g3[0, j], atol=1e-5, rtol=1e-5)


def test_kv_of_row_j_lands_in_slot_of_position_j(target):
    torch.manual_seed(3)
    ids = torch.randint(0, 512, (7,)).tolist()
    hidden = target_hidden(target, ids)
    head = random_head(target)
    table = [6, 2]
    _, _, kv = paged_head(head, ids[1:], hidden[:-1], table)
    with torch.no_grad():
        _, (k, v) = head.forward_dense(torch.tensor([ids[1:]]), hidden[None, :-1], torch.arange(6))
    slots = torch.tensor(slot_mapping(table, 0, 6, PAGE))
    k_paged, v_paged = kv.gather(0, slots)
    torch.testing.assert_close(k_paged, k[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v_paged, v[0], atol=1e-5, rtol=1e-5)
    # Nothing else written: every other slot of the pool is still zero.
    others = torch.ones(kv.num_pages * PAGE, dtype=torch.bool)
    others[slots] = False
    assert kv.flat(0)[0][others].abs().sum() == 0
    assert len(kv.k) == 1  # one layer


def test_norms_switch_changes_the_layout(target):
    with_norms, without = random_head(target, True), random_head(target, False)
    assert {"norm_embed.weight", "norm_hidden.weight", "norm.weight"} <= set(with_norms.state_dict())
    assert not any("norm_" in k or k == "norm.weight" for k in without.state_dict())
    # Same shared parameters otherwise: the difference in output comes from the norms alone.
    without.load_state_dict({k: v for k, v in with_norms.state_dict().items() if k in without.state_dict()})
    ids, h = torch.randint(0, 512, (1, 6)), torch.randn(1, 6, 64) * 3
    with torch.no_grad():
        a, _ = with_norms.forward_dense(ids, h, torch.arange(6))
        b, _ = without.forward_dense(ids, h, torch.arange(6))
    assert not torch.allclose(a, b, atol=1e-3)


@pytest.mark.parametrize("norms", [True, False])
def test_save_load_round_trip(tmp_path, norms):
    target = tiny_target(dtype=torch.bfloat16)
    head = random_head(target, norms)
    save_head(head, tmp_path / "head", {"steps": 7})
    cfg = json.loads((tmp_path / "head" / "config.json").read_text())
    assert cfg["head_type"] == "mtp" and cfg["norms"] is norms and cfg["steps"] == 7
    assert cfg["num_hidden_layers"] == 1 and cfg["hidden_size"] == 64 and cfg["vocab_size"] == 512
    saved = load_file(str(tmp_path / "head" / "model.safetensors"))
    assert not any("embed_tokens" in k or "lm_head" in k for k in saved)  # shared with the target
    assert set(saved) == set(head.state_dict())
    assert sum(v.numel() for v in saved.values()) < 100_000  # no 512 x 64 embedding in there
    loaded = load_head(tmp_path / "head", target)
    assert loaded.dtype == torch.bfloat16 and loaded.norms is norms
    assert loaded.embed_tokens is target.embed_tokens and loaded.lm_head is target.lm_head
    ids = torch.randint(0, 512, (9,)).tolist()
    hidden = target_hidden(target, ids)
    table = [1, 0, 3]
    g_a, logits_a, _ = paged_head(head, ids[1:], hidden[:-1], table)
    g_b, logits_b, _ = paged_head(loaded, ids[1:], hidden[:-1], table)
    assert torch.equal(g_a, g_b) and torch.equal(logits_a, logits_b)


def test_load_head_refuses_another_target(tmp_path, target):
    save_head(random_head(target), tmp_path / "head")
    with pytest.raises(ValueError, match="hidden 64.*another target.*hidden 32"):
        load_head(tmp_path / "head", tiny_target(hidden=32))
    with pytest.raises(ValueError, match="vocab"):
        load_head(tmp_path / "head", tiny_target(vocab=256))
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match="not an MTP head"):
        load_head(tmp_path / "draft", target)


def test_bf16_inference_is_batch_invariant():
    """Rows of two sequences in one pass == each alone (bf16, the runtime's dtype)."""
    target = tiny_target(dtype=torch.bfloat16)
    head = random_head(target)
    torch.manual_seed(4)
    a, b = torch.randint(0, 512, (6,)).tolist(), torch.randint(0, 512, (9,)).tolist()
    ha, hb = target_hidden(target, a), target_hidden(target, b)
    alone_a = paged_head(head, a[1:], ha[:-1], [0, 1])[1]
    alone_b = paged_head(head, b[1:], hb[:-1], [2, 3])[1]
    kv = head.new_kv_pool(8, PAGE)
    backend = ReferenceBackend()
    meta = backend.plan([SeqAttention(5, 5, [0, 1]), SeqAttention(8, 8, [2, 3])], PAGE)
    _, both = head(torch.tensor(a[1:] + b[1:]), torch.cat([ha[:-1], hb[:-1]]),
                   torch.cat([torch.arange(5), torch.arange(8)]), backend, kv, meta, torch.arange(13))
    assert torch.equal(both[:5], alone_a) and torch.equal(both[5:], alone_b)


def test_f32_dense_logits_over_a_bf16_target_cast_its_lm_head_once():
    """Training and evaluation run the head in f32 over a bf16 target's frozen lm_head: the
    logits are those of the f32 lm_head, from one kept copy (not a 100+ MB cast per call),
    made again when the target's lm_head tensor is another one."""
    target = tiny_target(dtype=torch.bfloat16)
    head = MTPHead(target.cfg, target, dtype=torch.float32)
    hidden = torch.randn(3, 5, target.cfg.hidden_size)
    want = hidden @ head.lm_head.float().T
    assert torch.equal(head.dense_logits(hidden), want)
    copy = head._lm_head_cast[1]
    head.dense_logits(hidden)
    assert head._lm_head_cast[1] is copy
    head.lm_head = head.lm_head * 2
    assert torch.allclose(head.dense_logits(hidden), 2 * want)


def bf16_head(matmul: str, norms: bool, trim: int, seed: int) -> tuple[MTPHead, torch.Generator]:
    """A random bf16 head on the tiny bf16 target (the fused CPU calls' case), its draft
    vocabulary trimmed to `trim` random tokens (0: not trimmed); and the generator, to go on with."""
    target = tiny_target(dtype=torch.bfloat16)
    head = MTPHead(target.cfg, target, norms=norms, matmul=matmul)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in head.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + torch.randn(p.shape, generator=gen) * 0.1)
    head.requires_grad_(False).eval()
    if trim:
        head.trim_vocabulary(torch.randperm(512, generator=gen)[:trim])
    return head, gen


@pytest.mark.parametrize("matmul", ["exact", "int8"])
@pytest.mark.parametrize("norms", [True, False])
@pytest.mark.parametrize("trim", [False, True])
def test_fused_cpu_forward_equals_the_python_forward(matmul, norms, trim):
    """bf16 on the CPU backend, the head's forward runs as one kernel call (kernels.head_step):
    the same bits as the op-by-op forward it replaces, in g, the logits and every KV slot it
    writes (and the value cache's pair copy), for a causal and a tree-masked sequence in one call;
    a weight changed in place is read on the next call."""
    from overlap.attention.cpu import CpuBackend
    from overlap.attention.base import tree_mask_from_parents
    from overlap.kv import KVPool

    head, gen = bf16_head(matmul, norms, 100 if trim else 0, seed=5)
    c = head.cfg
    k0 = torch.randn(8, PAGE, c.num_kv_heads, c.head_dim, generator=gen).bfloat16()
    v0 = torch.randn(8, PAGE, c.num_kv_heads, c.head_dim, generator=gen).bfloat16()
    ids, hidden = torch.randint(0, 512, (5,), generator=gen), torch.randn(5, 64, generator=gen).bfloat16()
    backend = CpuBackend()
    seqs = [SeqAttention(2, 7, [1, 2]), SeqAttention(3, 11, [3, 4, 5], tree_mask=tree_mask_from_parents([-1, 0, 0]))]
    positions, rows = torch.tensor([5, 6, 8, 9, 9]), torch.tensor([1, 4, 2])

    def pool():
        kv = KVPool(1, 8, PAGE, c.num_kv_heads, c.head_dim, torch.bfloat16, value_pairs=True)
        kv.k[0].copy_(k0)
        kv.v[0].copy_(v0)
        kv.sync_value_pairs()
        return kv

    def run(fused: bool):
        if fused:
            head.__dict__.pop("_fused_step", None)
        else:
            head._fused_step = lambda meta: None  # the op-by-op forward
        kv = pool()
        g, logits = head(ids, hidden, positions, backend, kv, backend.plan(seqs, PAGE), rows)
        return g, logits, kv._k_all, kv._v_all, kv.slot_arrays()[2]

    fused, python = run(True), run(False)
    assert head._fused.step is not None  # the fused call did run
    for got, want in zip(fused, python):
        assert torch.equal(got, want)
    assert torch.isinf(fused[1]).any() == trim

    def run_rows(fused: bool, sequences):
        # forward_rows: the fused call plans the attention itself from the lists.
        if fused:
            head.__dict__.pop("_fused_step", None)
        else:
            head._fused_step = lambda cpu_attention: None
        kv = pool()
        n = sum(s.q_len for s in sequences)
        g, logits = head.forward_rows(ids[:n], [hidden[:n]], positions[:n].tolist(), sequences, rows[rows < n].tolist(),
                                      backend, kv, PAGE)
        return g, logits, kv._k_all, kv._v_all, kv.slot_arrays()[2]

    for sequences in (seqs, seqs[1:], seqs[:1]):  # trees beside causal rows, a tree alone, causal alone
        for got, want in zip(run_rows(True, sequences), run_rows(False, sequences)):
            assert torch.equal(got, want)
    with torch.no_grad():
        head.layer.o_proj.mul_(2)  # in place: the packed copies must follow
    assert torch.equal(run(True)[1], run(False)[1])


@pytest.mark.parametrize("matmul", ["exact", "int8"])
@pytest.mark.parametrize("trim", [0, 100, 1])  # none, 100 tokens, fewer than a node's top-k
def test_the_one_call_tree_expansion_equals_the_python_levels(matmul, trim):
    """bf16 on the CPU backend, EAGLE's tree expansion runs as one call (MTPHead.expand_tree,
    head_step.cpp): the same node tokens and the same head KV (and value pairs) as the
    proposer's levels in Python, for the whole tree and for chains along its top path, over
    two sequences at different positions (value pairs where the CPU keeps them: AMX)."""
    from overlap.attention.cpu import CpuBackend
    from overlap.batch import SeqWork
    from overlap.speculative.eagle import EagleProposer
    from overlap.speculative.tree import TreeShape

    head, gen = bf16_head(matmul, True, trim, seed=7)
    c, shape = head.cfg, TreeShape.default(depth=3, topk=2, tokens=5)
    k0 = torch.randn(8, PAGE, c.num_kv_heads, c.head_dim, generator=gen).bfloat16()
    v0 = torch.randn(8, PAGE, c.num_kv_heads, c.head_dim, generator=gen).bfloat16()
    seqs = [SeqWork(0, [3], 9, [1, 2, 3], True), SeqWork(1, [7], 13, [4, 5, 6, 7], True)]
    carried = {s.seq_id: (torch.randn(512, generator=gen), torch.randn(c.hidden_size, generator=gen).bfloat16())
               for s in seqs}

    def expand(one_call: bool, only):
        proposer = EagleProposer(head, CpuBackend(), 8, PAGE, shape)
        proposer.kv.k[0].copy_(k0)
        proposer.kv.v[0].copy_(v0)
        proposer.kv.sync_value_pairs()
        proposer.carried = dict(carried)
        if not one_call:
            head.expand_tree = lambda *args: None  # the proposer's levels in Python
        try:
            tokens = proposer.propose_tree(seqs, only)
        finally:
            head.__dict__.pop("expand_tree", None)
        assert bool(proposer._tree_plans) == one_call  # the path asked for is the one that ran
        return tokens, proposer.kv._k_all, proposer.kv._v_all, proposer.kv.slot_arrays()[2]

    top = EagleProposer(head, CpuBackend(), 8, PAGE, shape).top_path
    for only in (None, set(top[:1]), set(top[:2]), set(top)):
        got, want = expand(True, only), expand(False, only)
        assert got[0].shape == (2, shape.size)
        for g, w in zip(got, want):
            assert (g is None and w is None) or torch.equal(g, w)  # no value pairs off AMX
