"""The cheap verification paths give the same tokens as the general one: greedy (argmax
compare, no probabilities) and one-hot drafts passed as probs=None (no [B, K, V] tensor)."""

import torch

from overlap.sampling import SamplingTensors, probabilities
from overlap.speculative.rejection import verify_chain, verify_greedy


def _case(seed, b=6, k=4, vocab=7):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, k + 1, vocab, generator=gen) * 2
    best = logits.argmax(-1)
    # Drafts that agree with the argmax for a random prefix, then anything.
    drafts = torch.randint(0, vocab, (b, k), generator=gen)
    agree = torch.randint(0, k + 1, (b,), generator=gen)
    cols = torch.arange(k)
    drafts = torch.where(cols[None, :] < agree[:, None], best[:, :k], drafts)
    num_drafts = torch.randint(0, k + 1, (b,), generator=gen)
    return logits, best, drafts, num_drafts


def _one_hot(tokens, vocab):
    return torch.zeros(*tokens.shape, vocab).scatter_(-1, tokens[..., None], 1.0)


def test_greedy_fast_path_equals_the_general_verifier():
    for seed in range(20):
        logits, best, drafts, num_drafts = _case(seed)
        b, k1, vocab = logits.shape
        p = _one_hot(best, vocab)  # greedy target: one-hot p
        seeds, first = torch.arange(b), torch.full((b,), 10)
        want_tokens, want_acc = verify_chain(p, _one_hot(drafts, vocab), drafts, num_drafts, seeds, first)
        got_tokens, got_acc = verify_greedy(best, drafts, num_drafts)
        assert torch.equal(got_acc, want_acc)
        for row in range(b):  # tokens past accepted + 1 are padding
            n = int(want_acc[row]) + 1
            assert torch.equal(got_tokens[row, :n], want_tokens[row, :n]), (seed, row)
        assert int(want_acc.sum()) > 0 or seed != 0  # the cases do accept drafts


def test_probs_none_means_one_hot_drafts_under_sampling():
    for seed in range(20):
        logits, _, drafts, num_drafts = _case(seed)
        b, k1, vocab = logits.shape
        st = SamplingTensors(torch.full((b * k1,), 0.8), torch.zeros(b * k1, dtype=torch.long),
                             torch.ones(b * k1), torch.arange(b * k1), False, False, False, False)
        p = probabilities(logits.view(-1, vocab), st).view(b, k1, vocab)
        seeds, first = torch.arange(b) * 7 + seed, torch.full((b,), 3)
        want = verify_chain(p, _one_hot(drafts, vocab), drafts, num_drafts, seeds, first)
        got = verify_chain(p, None, drafts, num_drafts, seeds, first)
        assert torch.equal(got[1], want[1])
        assert torch.equal(got[0], want[0])
