"""Tree verification (overlap/spec/tree.py) on toy targets with a known joint distribution:
several children per node, top-K (one-hot) drafts, duplicated candidates, greedy."""

import pytest
import torch

from overlap.spec.tree import TreeShape, children_table, verify_tree
from spec.markov import chi_square_gof

VOCAB = 4
ALPHA = 1e-4


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


@pytest.mark.parametrize("shape,duplicate", [
    (TreeShape(((0,), (1,), (0, 0), (0, 1), (1, 0))), False),  # 2 x 2 children
    (TreeShape(((0,), (1,), (2,), (0, 0), (0, 1), (0, 2))), False),  # 3 children per level
    (TreeShape(((0,), (1,), (0, 0), (0, 1))), True),  # duplicated candidates
    (TreeShape(((0,), (0, 0))), False),  # a chain: one child per node
])
def test_tree_verification_keeps_the_target_distribution(shape, duplicate):
    tokens, prefixes = build(shape, duplicate)
    n, b = shape.size, 40000
    probs = torch.stack([target_p(p) for p in prefixes]).float()  # [N+1, V]
    out, accepted, path = verify_tree(
        probs.expand(b, n + 1, VOCAB), torch.tensor(tokens).expand(b, n),
        torch.tensor(shape.parents()).expand(b, n), torch.tensor(shape.sibling_order()).expand(b, n),
        shape.depth, shape.max_children(), torch.arange(b), torch.full((b,), 10))
    # Complete every emitted prefix to 2 tokens with the true law, then compare with p^2.
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.long)
    for row, a in zip(out.tolist(), accepted.tolist()):
        seq = row[: a + 1]
        if len(seq) < 2:
            seq.append(int(torch.multinomial(target_p(tuple(seq)).float(), 1, generator=gen)))
        counts[seq[0], seq[1]] += 1
    law = torch.stack([target_p(()).double()[i] * target_p((i,)).double() for i in range(VOCAB)])
    stat, df, p_value = chi_square_gof(counts, law)
    assert p_value > ALPHA, f"chi-square {stat:.1f} on {df} df, p = {p_value:.2e}"
    assert accepted.float().mean() > 0.2  # the tree does get accepted paths
    # The path is a real root-to-node walk: each accepted node's parent is the previous one.
    parents = torch.tensor([0] + shape.parents())
    for row, a in zip(path.tolist()[:200], accepted.tolist()[:200]):
        prev = 0
        for node in row[:a]:
            assert parents[node] == prev
            prev = node


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


def test_tree_shapes():
    t = TreeShape.default(depth=3, topk=2, tokens=7)
    assert t.size == 7 and t.depth == 3 and t.max_children() == 2
    assert t.paths[0] == (0,) and all(p[:-1] in set(t.paths) | {()} for p in t.paths)
    assert t.parents() == [0, 0, 1, 1, 2, 3, 3]
    table = children_table(torch.tensor([t.parents()]), torch.tensor([t.sibling_order()]), 2)
    assert table[0, 0].tolist() == [1, 2] and table[0, 1].tolist() == [3, 4] and table[0, 7].tolist() == [0, 0]
