"""Proposers own their step: the executor drives every drafter through the interface of
overlap/speculative/base.py and never asks one what it is.

A proposer written against that interface alone (doubles.OracleProposer: no model, chains or
trees, drafts known on the host or made on the device) runs through the engine greedy-equal
to plain decoding, with drafts accepted and rejected."""

import ast
import inspect
from pathlib import Path

import pytest

from overlap.speculative.base import Proposer
from overlap.speculative.tree import TreeShape
from runtime.messages import SamplingParams
from speculative.doubles import OracleProposer
from speculative.test_spec_engine import engine, prompts

EXECUTOR = Path(__file__).resolve().parents[2] / "overlap" / "executor.py"


def test_the_executor_never_asks_a_proposer_what_it_is():
    """No getattr / hasattr / isinstance / type() in the executor (it used to branch on the
    drafter's attributes and methods), and no concrete drafter named in it."""
    tree = ast.parse(EXECUTOR.read_text(encoding="utf-8"))
    calls = sorted({node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "isinstance", "type")})
    assert not calls, f"overlap/executor.py calls {calls}"
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("overlap.speculative") for alias in node.names}
    drafters = {"DraftTargetProposer", "NgramProposer", "MTPProposer", "EagleProposer", "DynamicEagleProposer",
                "HeadProposer", "TreeShape"}
    assert not imported & drafters, imported & drafters


def test_the_double_uses_only_the_interface():
    """What the executor may call on a proposer is the Protocol's, and the double has no more
    public members than those (plus its own bookkeeping, read by these tests only)."""
    interface = {n for n in vars(Proposer) if not n.startswith("_")} | set(Proposer.__annotations__)
    assert interface == {"name", "state_on_host", "plan", "propose", "after_verify", "observe", "catch_up",
                         "release", "graph_runners"}
    public = {n for n, _ in inspect.getmembers(OracleProposer) if not n.startswith("_")}
    assert public <= interface, public - interface


SHAPE = TreeShape.default(3, 2, 6)  # (0) (0,0) (0,0,0) (1) (0,1) (1,0): a sibling with a child


@pytest.mark.parametrize("host", [False, True], ids=["device-drafts", "host-drafts"])
@pytest.mark.parametrize("shape", [None, SHAPE], ids=["chain", "tree"])
def test_a_proposer_on_the_interface_alone_runs_greedy_equal_to_plain(tiny_dirs, greedy_reference, shape, host):
    ps = prompts(4, seed=91)
    max_tokens = 24
    references = [p + out for p, out in zip(ps, greedy_reference(ps, max_tokens))]
    # The scheduler asks for k drafts per decoding sequence (a tree needs k >= its nodes);
    # the n-gram drafter it was built with is swapped for the double.
    eng = engine(tiny_dirs, "ngram", k=4 if shape is None else SHAPE.size)
    double = OracleProposer(references, eng.model.cfg.vocab_size, shape, host)
    eng.executor.proposer = double
    results = eng.generate(ps, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    eng.close()
    assert [r.token_ids for r in results] == greedy_reference(ps, max_tokens)
    # Its drafts went through verification: many accepted, some rejected.
    assert 0 < double.accepted < double.proposed, (double.accepted, double.proposed)
    assert double.accepted > 2 * len(ps)
