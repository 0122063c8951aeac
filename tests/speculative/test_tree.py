"""Tree verification (overlap/speculative/tree.py) on toy targets with a known joint distribution:
several children per node, top-K (one-hot) drafts, duplicated candidates, depth 3 (the bonus
after a depth-3 leaf), greedy. The law of depth + 1 tokens (the longest a step emits) is
checked by markov.assert_law (alpha = markov.ALPHA per test), and broken walks
(speculative/doubles.py) are rejected by the same test and sample size."""

import functools
import itertools

import pytest
import torch

from overlap.speculative.tree import TreeShape, children_table, top_path_accepted, verify_tree, verify_tree_greedy
from speculative import doubles
from speculative.markov import assert_law, law_rejected

VOCAB = 4
ROWS = 40000


@functools.lru_cache(maxsize=None)
def target_p(prefix: tuple[int, ...]) -> torch.Tensor:
    """A fixed, prefix-dependent next-token law over VOCAB tokens (a toy 'target')."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    w = torch.rand(VOCAB, generator=g, dtype=torch.float64) ** 2 + 0.02
    return w / w.sum()


def draft_rank(prefix: tuple[int, ...]) -> list[int]:
    """A 'drafter': tokens in the order of a different prefix-dependent law."""
    g = torch.Generator().manual_seed((hash(prefix) * 7 + 3) % (2**31))
    return torch.randperm(VOCAB, generator=g).tolist()


def build(shape: TreeShape, duplicate: bool = False):
    """Node tokens from the drafter's ranking; optionally the 2nd child of every node repeats
    the 1st (duplicated candidates)."""
    tokens, prefixes = [], []
    for path in shape.paths:
        prefix = ()
        for depth, rank in enumerate(path):
            ranked = draft_rank(prefix)
            tok = ranked[0] if (duplicate and rank == 1) else ranked[rank]
            prefix = prefix + (tok,)
        tokens.append(prefix[-1])
        prefixes.append(prefix)
    return tokens, [()] + prefixes


def exact_law(length: int) -> torch.Tensor:
    """[VOCAB] * length f64: the target's law of `length` tokens after the root."""
    law = torch.zeros([VOCAB] * length, dtype=torch.float64)
    for seq in itertools.product(range(VOCAB), repeat=length):
        law[seq] = torch.prod(torch.stack([target_p(seq[:i])[seq[i]] for i in range(length)]))
    return law


def complete(out: torch.Tensor, accepted: torch.Tensor, length: int) -> torch.Tensor:
    """Each row's emitted tokens out[:, :accepted+1], completed to `length` tokens with the true
    law (a fixed generator): a correct walk makes every row a draw from exact_law(length)."""
    gen = torch.Generator().manual_seed(0)
    tokens = out[:, :length].clone()
    for i in range(1, length):
        todo = (accepted + 1 <= i).nonzero()[:, 0]
        if todo.numel():
            prefixes = [tuple(r) for r in tokens[todo, :i].tolist()]
            probs = torch.stack([target_p(p) for p in prefixes]).float()
            tokens[todo, i] = torch.multinomial(probs, 1, generator=gen)[:, 0]
    return tokens


def run_tree(shape: TreeShape, duplicate: bool = False, verify=verify_tree):
    tokens, prefixes = build(shape, duplicate)
    n, b = shape.size, ROWS
    probs = torch.stack([target_p(p) for p in prefixes]).float()  # [N+1, V]
    return verify(
        probs.expand(b, n + 1, VOCAB), torch.tensor(tokens).expand(b, n),
        torch.tensor(shape.parents()).expand(b, n), torch.tensor(shape.sibling_order()).expand(b, n),
        shape.depth, shape.max_children(), torch.arange(b), torch.full((b,), 10))


DEPTH3 = TreeShape(((0,), (1,), (0, 0), (0, 1), (0, 0, 0), (0, 0, 1), (0, 1, 0)))


@pytest.mark.parametrize("shape,duplicate", [
    (TreeShape(((0,), (1,), (0, 0), (0, 1), (1, 0))), False),  # 2 x 2 children
    (TreeShape(((0,), (1,), (2,), (0, 0), (0, 1), (0, 2))), False),  # 3 children per level
    (TreeShape(((0,), (1,), (0, 0), (0, 1))), True),  # duplicated candidates
    (TreeShape(((0,), (0, 0))), False),  # a chain: one child per node
    (DEPTH3, False),  # depth 3: the bonus after a depth-3 leaf is token 4
])
def test_tree_verification_keeps_the_target_distribution(shape, duplicate):
    out, accepted, path = run_tree(shape, duplicate)
    length = shape.depth + 1
    assert int((accepted == shape.depth).sum()) > ROWS // 20  # many steps end with a bonus
    assert_law(complete(out, accepted, length), exact_law(length))
    # The path is a real root-to-node walk: each accepted node's parent is the previous one.
    parents = torch.tensor([0] + shape.parents())
    for row, a in zip(path.tolist()[:200], accepted.tolist()[:200]):
        prev = 0
        for node in row[:a]:
            assert parents[node] == prev
            prev = node


@pytest.mark.parametrize("bug", sorted(doubles.BUGS))
def test_the_law_test_rejects_a_broken_tree_walk(bug):
    """Siblings tested (and the extra token drawn) against p instead of the residual, or a
    child's accept test reading p from the child's own row."""
    verify = functools.partial(doubles.verify_tree, **doubles.broken(bug))
    out, accepted, _ = run_tree(DEPTH3, verify=verify)
    rejected, pvalues = law_rejected(complete(out, accepted, 4), exact_law(4))
    assert rejected, pvalues


def test_greedy_tree_follows_the_argmax():
    shape = TreeShape.default(3, 2, 7)
    tokens, prefixes = build(shape)
    one_hot = torch.stack([torch.nn.functional.one_hot(target_p(p).argmax(), VOCAB) for p in prefixes]).float()
    out, accepted, _ = verify_tree(one_hot[None], torch.tensor([tokens]), torch.tensor([shape.parents()]),
                                   torch.tensor([shape.sibling_order()]), shape.depth, shape.max_children(),
                                   torch.tensor([1]), torch.tensor([5]))
    greedy, prefix = [], ()
    for _ in range(accepted.item() + 1):
        greedy.append(int(target_p(prefix).argmax()))
        prefix += (greedy[-1],)
    assert out[0, : accepted.item() + 1].tolist() == greedy
    # The walk stopped only where no child had the argmax token.
    present = {p for p in prefixes[1:]}
    assert tuple(greedy) not in present


@pytest.mark.parametrize("shape", [DEPTH3, TreeShape.default(3, 2, 8), TreeShape.default(4, 3, 12),
                                   TreeShape(((0,), (0, 0), (0, 0, 0)))])
def test_greedy_tree_walk_equals_the_walk_on_one_hot_p(shape):
    """verify_tree_greedy (the executor's all-greedy path: argmaxes, no probabilities) gives
    verify_tree's tokens, counts and paths on one-hot p, for random trees over a tiny
    vocabulary (many matches, repeated sibling tokens), and for rows whose tree nobody can
    enter (every node its own parent: a plainly decoding row beside the trees); except where
    two siblings hold the argmax and the later one's matches run deeper: there it accepts
    more, along a path where every node holds the argmax after its parent. (Random argmaxes
    per node: a real target gives two nodes with the same tokens above them the same
    argmax, so there both paths spell the same tokens.)"""
    b, n, gen = 3000, shape.size, torch.Generator().manual_seed(5)
    best = torch.randint(0, VOCAB, (b, n + 1), generator=gen)
    tokens = torch.randint(0, VOCAB, (b, n), generator=gen)
    parents = torch.tensor(shape.parents()).repeat(b, 1)
    closed = torch.rand(b, generator=gen) < 0.1
    parents[closed] = torch.arange(1, n + 1)
    order = torch.tensor(shape.sibling_order()).repeat(b, 1)
    one_hot = torch.nn.functional.one_hot(best, VOCAB).float()
    walked = verify_tree(one_hot, tokens, parents, order, shape.depth, shape.max_children(),
                         torch.arange(b), torch.full((b,), 7))
    greedy = verify_tree_greedy(best, tokens, parents, order, shape.depth, shape.max_children())
    same = greedy[1] == walked[1]
    for a, g in zip(walked, greedy):
        assert torch.equal(a[same], g[same])
    assert bool((greedy[1] >= walked[1]).all())
    for row in (~same).nonzero()[:, 0].tolist():
        a, path = int(greedy[1][row]), greedy[2][row]
        assert greedy[0][row, :a].tolist() == tokens[row, path[:a] - 1].tolist()
        nodes = [0] + path[:a].tolist()  # each accepted node holds the argmax after its parent
        assert greedy[0][row, :a + 1].tolist() == [int(best[row, v]) for v in nodes]
    if shape.max_children() > 1:
        assert int((~same).sum()) > 0  # repeated sibling tokens: the deeper one was taken
    assert greedy[1].tolist() == _deepest_matching_paths(best, tokens, parents, shape.depth)
    assert greedy[1].float().mean() > 0.1 and int((greedy[1] == shape.depth).sum()) > 0
    assert int(greedy[1][closed].sum()) == 0


def _deepest_matching_paths(best: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, depth: int) -> list[int]:
    """Per row, by brute force: the most nodes on a path down from the root (at most `depth`)
    where every node holds the argmax after its parent."""
    out = []
    for b_row, t_row, p_row in zip(best.tolist(), tokens.tolist(), parents.tolist()):
        kids: dict[int, list[int]] = {}
        for node, parent in enumerate(p_row, start=1):
            if parent != node:  # a closed node (its own parent) is nobody's child
                kids.setdefault(parent, []).append(node)

        def longest(node: int, left: int) -> int:
            return max([1 + longest(c, left - 1) for c in kids.get(node, [])
                        if left > 0 and t_row[c - 1] == b_row[node]] or [0])
        out.append(longest(0, depth))
    return out


@pytest.mark.parametrize("torch_only", [False, True], ids=["kernel", "torch"])
def test_greedy_walk_takes_the_deeper_of_two_matching_siblings(torch_only):
    """A lookup branch (tried first) and the head's child with the same token: the branch
    stops after one node, the head's chain matches three deep."""
    parents = torch.tensor([[0, 1, 2, 0]])  # nodes 1-3: the head's chain; node 4: the branch
    order = torch.tensor([[1, 0, 0, 0]])  # the branch is tried first at the root
    tokens = torch.tensor([[5, 6, 7, 5]])
    best = torch.tensor([[5, 6, 7, 8, 9]])  # argmax after root, 1, 2, 3, 4
    out, accepted, path = verify_tree_greedy(best, tokens, parents, order, 3, 2, torch_only=torch_only)
    assert accepted.tolist() == [3] and path.tolist() == [[1, 2, 3]] and out.tolist() == [[5, 6, 7, 8]]
    best[0, 1] = 0  # the chain's second node misses: tie at one node each, the branch (first) wins
    out, accepted, path = verify_tree_greedy(best, tokens, parents, order, 3, 2, torch_only=torch_only)
    assert accepted.tolist() == [1] and path[0, 0].item() == 4 and out[0, :2].tolist() == [5, 9]


def test_top_path_accepted_is_what_its_chain_alone_accepts():
    """Greedy: the leading top-path nodes holding the target's choice, also where the walk took
    an equal sibling (the branch) or left the path for another child; sampled: where the
    accepted path ran through the top path's nodes."""
    parents = torch.tensor([[0, 1, 2, 0, 0]])  # nodes 1-3: the head's top path; 4: a branch; 5: a sibling
    order = torch.tensor([[1, 0, 0, 0, 2]])
    tokens = torch.tensor([[5, 6, 7, 5, 4]])
    top = torch.tensor([[1, 2, 3]])
    best = torch.tensor([[5, 6, 0, 8, 9, 3]])  # the top path holds 2; the branch (tried first) 1
    _, accepted, path = verify_tree_greedy(best, tokens, parents, order, 3, 3)
    assert accepted.tolist() == [2] and top_path_accepted(top, path, accepted, tokens, best).tolist() == [2]
    best = torch.tensor([[5, 9, 7, 8, 9, 3]])  # the walk takes the branch (4) at a tie of one node
    _, accepted, path = verify_tree_greedy(best, tokens, parents, order, 3, 3)
    assert path[0, 0].item() == 4 and top_path_accepted(top, path, accepted, tokens, best).tolist() == [1]
    best = torch.tensor([[4, 6, 7, 8, 9, 3]])  # only the sibling (node 5) holds the first choice
    _, accepted, path = verify_tree_greedy(best, tokens, parents, order, 3, 3)
    assert accepted.tolist() == [1] and top_path_accepted(top, path, accepted, tokens, best).tolist() == [0]
    # Sampled: from the walk's path; a shorter top path is padded with 0 (never counted); a
    # tree without one (EAGLE-2's grown trees, a row without drafts) reports nothing: -1.
    path, accepted = torch.tensor([[1, 2, 0], [5, 0, 0], [1, 2, 3], [1, 2, 0]]), torch.tensor([2, 1, 3, 2])
    tops = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 0], [0, 0, 0]])
    assert top_path_accepted(tops, path, accepted).tolist() == [2, 0, 2, -1]
    best = torch.tensor([[5, 6, 7, 8, 9, 3]])
    _, accepted, path = verify_tree_greedy(best, tokens, parents, order, 3, 3)
    assert top_path_accepted(torch.zeros(1, 3, dtype=torch.long), path, accepted, tokens, best).tolist() == [-1]


@pytest.mark.parametrize("shape", [DEPTH3, TreeShape.default(3, 2, 8), TreeShape.default(4, 3, 12),
                                   TreeShape(((0,), (0, 0), (0, 0, 0)))])
def test_the_compiled_greedy_walk_equals_the_torch_ops(shape):
    """kernels.tree_walk_greedy (tree_walk.cpp, what the CPU runs) against the torch ops of
    verify_tree_greedy (what CUDA runs), on random trees over a tiny vocabulary with repeated
    sibling tokens, closed rows, a branch of 8 beside the tree (deeper than it, tried first,
    as lookup_branch.py lays it out) and a walk as deep as the tree or deeper."""
    b, n, gen = 2000, shape.size, torch.Generator().manual_seed(11)
    branch = 8
    parents = torch.tensor(shape.parents() + [0] + [n + 1 + i for i in range(branch - 1)]).repeat(b, 1)
    order = torch.tensor([o + (p == 0) for p, o in zip(shape.parents(), shape.sibling_order())]
                         + [0] * branch).repeat(b, 1)
    closed = torch.rand(b, generator=gen) < 0.1
    parents[closed] = torch.arange(1, n + branch + 1)
    order[closed] = 0
    best = torch.randint(0, VOCAB, (b, n + branch + 1), generator=gen)
    tokens = torch.randint(0, VOCAB, (b, n + branch), generator=gen)
    for depth in (branch, branch + 2):
        compiled = verify_tree_greedy(best, tokens, parents, order, depth, shape.max_children() + 1)
        ops = verify_tree_greedy(best, tokens, parents, order, depth, shape.max_children() + 1, torch_only=True)
        for a, g in zip(compiled, ops):
            assert torch.equal(a, g)
        assert int((compiled[1] > shape.depth).sum()) > 0  # walks down the branch past the tree


def test_tree_shapes():
    t = TreeShape.default(depth=3, topk=2, tokens=7)
    assert t.size == 7 and t.depth == 3 and t.max_children() == 2
    assert t.paths[0] == (0,) and all(p[:-1] in set(t.paths) | {()} for p in t.paths)
    assert t.parents() == [0, 0, 1, 1, 2, 3, 3]
    table = children_table(torch.tensor([t.parents()]), torch.tensor([t.sibling_order()]), 2)
    assert table[0, 0].tolist() == [1, 2] and table[0, 1].tolist() == [3, 4] and table[0, 7].tolist() == [0, 0]


def test_the_compiled_verification_tail_equals_the_torch_ops():
    """kernels.verify_trees_greedy and kernels.compact_paths (tree_walk.cpp: what a greedy tree
    step runs on the CPU, executor._verify_trees) against the torch ops CUDA runs: the argmax
    table, the walk, the top path's count, and the accepted paths' KV (every layer, V's pair
    copy) and hidden states moved into place; rows with fewer drafts (cells left 0), ties in
    the logits, top paths of every length and none."""
    from overlap import kernels
    from overlap.kv import KVPool

    shape, gen = TreeShape.default(3, 2, 8), torch.Generator().manual_seed(5)
    b, n, depth, page, vocab = 64, shape.size, shape.depth, 4, 6
    parents = torch.tensor(shape.parents()).repeat(b, 1)
    order = torch.tensor(shape.sibling_order()).repeat(b, 1)
    tokens = torch.randint(0, vocab, (b, n), generator=gen)
    drafted = torch.randint(0, n + 1, (b,), generator=gen)  # rows verified per tree: drafted + 1
    rows_at = torch.cat([torch.arange(i * (n + 1), i * (n + 1) + k + 1) for i, k in enumerate(drafted.tolist())])
    logits = torch.randint(0, 4, (len(rows_at), vocab), generator=gen).float()  # ties: the first wins
    first_path = [i + 1 for i, p in enumerate(shape.parents()) if i == 0 or p == i][:depth]  # nodes 1, 2, ...
    top = torch.tensor([(first_path[:int(k)] + [0] * depth)[:depth] for k in torch.randint(0, depth + 1, (b,), generator=gen)])

    best = torch.zeros(b * (n + 1), dtype=torch.long)
    best[rows_at] = logits.argmax(-1)
    best = best.view(b, n + 1)
    want = verify_tree_greedy(best, tokens, parents, order, depth, shape.max_children(), torch_only=True)
    want = (*want, top_path_accepted(top, want[2], want[1], tokens, best))
    got = kernels.verify_trees_greedy(logits, rows_at, tokens, parents, order, depth, shape.max_children(), top)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert (got[3] == -1).any() and (got[3] > 0).any() and (got[1] > 0).any()
    accepted, path = got[1], got[2]

    # The compaction: each tree's block of n + 1 rows and slots; depth i moves to slot/row 1 + i.
    layers, heads, dim = 2, 2, 8
    slots = torch.randperm(b * (n + 1) * 2, generator=gen)[: b * (n + 1)].view(b, n + 1)
    starts = torch.arange(b) * (n + 1)
    moved_rows = starts[:, None] + 1 + torch.arange(depth)[None, :]
    hidden = torch.randn(b * (n + 1), 16, generator=gen)
    pages = b * (n + 1) * 2 // page

    def pool():
        kv = KVPool(layers, pages, page, heads, dim, torch.bfloat16, value_pairs=True)
        kv._k_all.copy_(torch.randn(kv._k_all.shape, generator=torch.Generator().manual_seed(1)))
        kv._v_all.copy_(torch.randn(kv._v_all.shape, generator=torch.Generator().manual_seed(2)))
        kv.sync_value_pairs()
        return kv

    ref = pool()
    keep = torch.arange(depth)[None, :] < accepted[:, None]
    dst = slots[:, 1:depth + 1]
    src, dst = torch.where(keep, slots.gather(1, path), dst).reshape(-1), dst.reshape(-1)
    for cache in ref.slot_arrays()[:2]:  # the torch ops (KVPool.copy_slots on CUDA), not the kernel
        cache.index_copy_(1, dst, cache.index_select(1, src))
    ref.sync_value_pairs()
    moved_ref = hidden.clone()
    moved_ref[moved_rows.reshape(-1)] = hidden[torch.where(keep, starts[:, None] + path, moved_rows).reshape(-1)]
    kv = pool()
    k, v, pairs = kv.slot_arrays()
    moved = kernels.compact_paths(accepted, path, slots, starts, moved_rows, hidden, k, v, pairs, page)
    assert torch.equal(moved, moved_ref) and not torch.equal(moved, hidden)
    for a, r in zip(kv.slot_arrays(), ref.slot_arrays()):
        assert torch.equal(a, r)
