"""The `overlap` command line.

    overlap generate "The capital of France is" --max-tokens 8
    overlap generate "Write a haiku about the sea" --chat --temperature 0.7 --seed 1
    overlap generate "def fib(n):" --spec ngram --num-spec-tokens 4 --json
    overlap bench --prompts prompts/dev.jsonl --num-prompts 4 --concurrency 1 4 --compare-hf
    overlap bench --prompts prompts/dev.jsonl --spec none draft ngram --num-spec-tokens 4
    overlap bench --prompts prompts/dev.jsonl --spec none draft --no-overlap
    overlap serve --config configs/smollm2-135m-draft.toml --zmq tcp://127.0.0.1:5557
    overlap generate "def fib(n):" --server tcp://127.0.0.1:5557
    overlap serve --http 8000 ...          (and an OpenAI-compatible HTTP API on 127.0.0.1:8000/v1)
    overlap http --server tcp://127.0.0.1:5557 --listen 127.0.0.1:8000
    overlap bench --prompts prompts/dev.jsonl --server tcp://127.0.0.1:5557 --spec none draft --compare-inprocess
    overlap bench --prompts prompts/dev.jsonl --server tcp://127.0.0.1:5557 --http http://127.0.0.1:8000 \
        --spec none --concurrency 8 --compare-inprocess --scrape-metrics 1
    overlap convert [MODEL.gguf] [--out DIR]

Bad input (an empty prompt, --max-tokens 0, a missing model or prompts file, a prompt longer
than the context, a listen address already in use, an empty --token, no server at --server)
ends with one line `overlap: error: ...` on stderr and exit code 2, never a traceback: the
user needs to know what to fix, not where the check lives. A server process that fails to
start ends `overlap serve` with one such line and exit code 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from pathlib import Path

import msgspec

from overlap.config import (BRANCHED_METHODS, HEAD_METHODS, EngineConfig, SpecConfig, check_device, default_draft_dir,
                            default_head_dir, load_config)
from overlap.models.loading import ModelNotFoundError, default_gguf_path
from runtime.messages import RequestError, SamplingParams

EXIT_USAGE = 2
EXIT_FAILURE = 1
SPEC_METHODS = ("none", "draft", "ngram", "mtp", "eagle")
PROBE_TIMEOUT_S = 3.0  # --server: how long the health probe before the first request waits
LOG_LEVELS = ("debug", "info", "warning", "error")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("overlap")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line (its default adds the usage block)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"overlap: error: {message} (see `{self.prog} --help`)\n")


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


# -- arguments -----------------------------------------------------------------------------


def _add_engine_options(p: argparse.ArgumentParser, bench: bool = False) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", metavar="PATH", help="GGUF file or HF model directory (default: the shipped model)")
    g.add_argument("--config", metavar="FILE", help="engine config TOML (configs/NAME.toml); flags override it")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), help="weight/activation dtype (default: bfloat16)")
    g.add_argument("--device", metavar="cpu|cuda[:N]",
                   help="where the models run (default: the config's, cpu); cuda needs a CUDA build of torch")
    g.add_argument("--attention-backend", choices=("auto", "cpu", "reference", "torch", "flashinfer"),
                   help="attention kernels: cpu (overlap's compiled batch-invariant kernel), reference (pure "
                        "torch, float64: the test oracle; on cuda its math with device metadata), torch (that "
                        "math on any device: the CUDA fallback without FlashInfer) or flashinfer (CUDA, the "
                        "`gpu` extra); default auto: flashinfer on cuda (torch when flashinfer is missing), "
                        "cpu on cpu")
    g.add_argument("--matmul", choices=("exact", "fast"),
                   help="bf16 matmuls on the CPU: exact (overlap's batch-invariant kernel: greedy speculation "
                        "equals plain decoding on every CPU; the default) or fast (oneDNN as it chooses: row "
                        "results depend on the batch, so greedy outputs may part at near-ties)")
    g.add_argument("--page-size", type=_positive_int, metavar="N", help="tokens per KV page")
    g.add_argument("--num-pages", type=_positive_int, metavar="N", help="KV pages in the cache")
    g.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false", default=None,
                   help="do not keep full KV pages for later requests that share a prefix (prefix caching "
                        "is on by default: docs/prefix_caching.md)")
    g.add_argument("--max-num-seqs", type=_positive_int, metavar="N", help="sequences per batch")
    g.add_argument("--max-batched-tokens", type=_positive_int, metavar="N", help="tokens per step")
    g.add_argument("--num-spec-tokens", type=_positive_int, metavar="K",
                   help="draft tokens per step for draft/ngram/mtp (default: 4); an error with eagle, whose "
                        "tree is shaped by --tree-depth/--tree-topk/--tree-tokens")
    g.add_argument("--tp", type=_positive_int, metavar="N",
                   help="tensor parallelism: shard the target over N ranks (gloo on CPU, NCCL on GPU)")
    g.add_argument("--draft-model", metavar="DIR",
                   help="draft directory for --spec draft (default: the shipped draft of the default model)")
    g.add_argument("--head", metavar="DIR",
                   help="MTP head directory for --spec mtp/eagle (default: the shipped head of the default model)")
    g.add_argument("--tree-depth", type=_positive_int, metavar="D", help="--spec eagle: tree levels (default 3)")
    g.add_argument("--tree-topk", type=_positive_int, metavar="K", help="--spec eagle: children per node (default 2)")
    g.add_argument("--tree-tokens", type=_positive_int, metavar="N", help="--spec eagle: tree nodes (default: 7 on AMX CPUs and GPUs, 5 on other "
                        "CPUs, whose matmuls tile 6 rows; bench: eagle:N runs a tree of N nodes)")
    g.add_argument("--draft-vocab", type=_non_negative_int, metavar="N", nargs="+" if bench else None,
                   help="--spec mtp/eagle: the head scores only the N most frequent tokens (FR-Spec; e.g. 4096), "
                        "a cheaper draft step; 0 = the full vocabulary; default: the head's own (its config's "
                        "draft_vocab: 4096 for the shipped head). Outputs do not change"
                        + ("; bench: give several to run each head mode (mtp, eagle) with each" if bench else ""))
    g.add_argument("--drafter-weights", choices=("auto", "bf16", "int8"), nargs="+" if bench else None,
                   metavar="auto|bf16|int8",
                   help="--spec draft/mtp/eagle: the drafter's own weights in bf16, or int8 (one scale per "
                        "output row; steps read half the bytes; CPU only). The target stays bf16: outputs "
                        "do not change (default: auto = int8 for a bf16 target on an AVX2-or-better CPU, else bf16)"
                        + ("; bench: give both to run each drafting mode with each" if bench else ""))
    g.add_argument("--lookup-branch", type=_non_negative_int, nargs="+" if bench else None, metavar="L",
                   help="--spec draft/mtp/eagle: verify up to L tokens of prompt lookup (the continuation of "
                        "the context's last n-gram where it occurred before) beside the drafter's drafts, as one "
                        "more branch of the step's tree; pays where the text copies (code: arguments, repeated "
                        "lines). Outputs do not change (default 0: off)"
                        + ("; bench: give several to run each model-drafter mode with each" if bench else ""))
    g.add_argument("--tree", choices=("static", "dynamic"),
                   help="--spec eagle: a fixed tree shape, or EAGLE-2's dynamic one (default: static)")
    g.add_argument("--speculation-controller", choices=("on", "off"), nargs="+" if bench else None,
                   metavar="on|off",
                   help="on: a cost model chooses each request's drafts (or tree) per step, up to its cap, to "
                        "maximise tokens per second (turns speculation down in compute-bound batches and for "
                        "requests whose drafts miss); off: every step verifies the cap (default: on)"
                        + ("; bench: give both to run each speculative mode with it on and off" if bench else ""))
    g.add_argument("--cost-curve", metavar="FILE.json",
                   help="the controller's step-cost curve: a `bench --step-costs --json` report (default: "
                        "measured at start-up with a few forwards, cached under ~/.cache/overlap/step_costs)")


def _spec_mode(text: str) -> str:
    """A bench mode: none | draft | ngram | mtp | eagle, optionally ":K" drafts (mtp:3), or
    eagle:static / eagle:dynamic / eagle:N (a tree of N nodes)."""
    mode, _, k = text.partition(":")
    if mode not in SPEC_METHODS:
        raise argparse.ArgumentTypeError(f"unknown mode {mode!r} (choose from {', '.join(SPEC_METHODS)})")
    if mode == "eagle" and k in ("", "static", "dynamic"):
        return text
    if k and (not k.isdigit() or int(k) < 1 or mode == "none"):
        raise argparse.ArgumentTypeError(f"{text!r}: K must be a positive integer (drafts for draft/ngram/mtp, "
                                         "tree nodes for eagle)")
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="overlap", description="Speculative-decoding LLM inference runtime.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout")
    gen.add_argument("prompt", metavar="PROMPT")
    gen.add_argument("--max-tokens", type=int, default=128, metavar="N")
    gen.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, metavar="P")
    gen.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = off")
    gen.add_argument("--seed", type=int, metavar="S")
    gen.add_argument("--stop", nargs="+", action="extend", default=[], metavar="STR",
                     help="stop strings (not included in the output)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--json", action="store_true",
                     help="print one JSON object {text, token_ids, finish_reason, stats} instead of streaming")
    gen.add_argument("--spec", choices=SPEC_METHODS, metavar="MODE",
                     help="speculative decoding: none | draft | ngram | mtp | eagle (default: the config's, none); "
                          "with --server: none switches it off for this request, else it must be the server's")
    gen.add_argument("--server", metavar="ADDRESS",
                     help="run on an `overlap serve` daemon (e.g. tcp://127.0.0.1:5557) instead of in process")
    gen.add_argument("--timeout", type=float, default=300.0, metavar="S",
                     help="with --server: seconds to wait for each reply (default: 300)")
    _add_engine_options(gen)

    bench = sub.add_parser("bench", help="throughput/latency benchmark over a JSONL prompt file")
    bench.add_argument("--prompts", metavar="FILE.jsonl",
                       help="one JSON object per line with a \"prompt\" field, used raw, and optionally "
                            "a \"kind\" (code, chat, ...) that the report splits acceptance by")
    bench.add_argument("--max-tokens", type=int, default=128, metavar="N")
    bench.add_argument("--concurrency", type=_positive_int, nargs="+", default=[1], metavar="C",
                       help="requests kept in flight; several values run one after another")
    bench.add_argument("--num-prompts", type=_positive_int, metavar="N", help="use the first N prompts")
    bench.add_argument("--rounds", type=_positive_int, default=1, metavar="R",
                       help="run every (mode, concurrency) R times, interleaved, all modes loaded at once: "
                            "speedups are the median of the ratios paired round by round, shown with their "
                            "range (the run's own noise band); every prompt runs once first, so every round finds "
                            "its pages in the prefix cache; default 1: one mode after another")
    bench.add_argument("--interleave", choices=("rounds", "prompts"), default="rounds",
                       help="how the modes take turns (all loaded at once): rounds (with --rounds: each round "
                            "runs every mode back to back), or prompts: at concurrency 1 every prompt runs on "
                            "each mode in turn, so a slow spell of a shared host (seconds to minutes) falls on "
                            "all modes alike; other concurrencies keep the round's order")
    bench.add_argument("--json", metavar="OUT", help="write the full report as JSON to OUT")
    bench.add_argument("--compare-hf", action="store_true",
                       help="also run transformers (batch 1) and compare speed and outputs")
    bench.add_argument("--spec", type=_spec_mode, nargs="+", metavar="MODE[:K]",
                       help="speculative modes to compare, one engine each: none draft ngram "
                            "(default: the config's, none); speedups are over the first (none if given)")
    bench.add_argument("--server", metavar="ADDRESS",
                       help="benchmark an `overlap serve` daemon through the client library; --spec may "
                            "then be none (speculation off per request) and/or the server's own mode")
    bench.add_argument("--http", metavar="URL",
                       help="with --server: also run each server mode through the daemon's OpenAI HTTP server "
                            "at URL (`overlap serve --http`; streamed /v1/completions), as \"MODE @http\"")
    bench.add_argument("--http-token", metavar="SECRET",
                       help="with --http: the server's bearer token (default: $OVERLAP_BRIDGE_TOKEN)")
    bench.add_argument("--scrape-metrics", type=float, metavar="S",
                       help="with --http: also run each HTTP variant while GET /metrics runs every S seconds "
                            "(\"MODE @http +metrics\"): the cost of being scraped")
    bench.add_argument("--compare-inprocess", action="store_true",
                       help="with --server: also run the in-process engine (same config) in this run")
    bench.add_argument("--compare-tp", type=_positive_int, nargs="+", metavar="N",
                       help="also run each in-process mode at these tensor-parallel sizes (e.g. 2), side by side")
    bench.add_argument("--no-overlap", action="store_true",
                       help="also run each in-process mode with overlap off (plan only after the "
                            "previous step finished), side by side")
    bench.add_argument("--aa", action="store_true",
                       help="also run a second, identical `none` engine (\"none A/A\"): its speedup over "
                            "`none` is this run's own noise, the yardstick for every other ratio (best "
                            "with --rounds)")
    bench.add_argument("--step-costs", action="store_true",
                       help="instead of prompts: time one target step for 1-16 rows per sequence at batch 1 "
                            "and 8 (context --context), one MTP-head step and one draft-model step; prints "
                            "the table, --json writes it, --plot draws ms vs rows")
    bench.add_argument("--context", type=_positive_int, default=256, metavar="N",
                       help="with --step-costs: cached tokens per sequence (default: 256)")
    bench.add_argument("--shared-prefix", type=_positive_int, metavar="N",
                       help="put the same N tokens of a long system prompt in front of every prompt, and run "
                            "every mode with the prefix cache and without (\"MODE no-prefix-cache\"): the TTFT "
                            "the cache saves (at --concurrency 1 every measured request hits it)")
    bench.add_argument("--plot", metavar="OUT.png",
                       help="write a PNG: tok/s vs concurrency per mode and acceptance per position (with "
                            "--step-costs: ms vs rows per sequence)")
    _add_engine_options(bench, bench=True)

    srv = sub.add_parser("serve", help="run the server: tokenizer, scheduler and executor processes")
    srv.add_argument("--zmq", default="tcp://127.0.0.1:5557", metavar="ADDRESS",
                     help="where clients connect (default: tcp://127.0.0.1:5557, loopback only; "
                          "a port of * picks a free one)")
    srv.add_argument("--spec", choices=SPEC_METHODS, metavar="MODE",
                     help="speculative decoding: none | draft | ngram | mtp | eagle (default: the config's, none)")
    srv.add_argument("--max-waiting", type=_positive_int, default=1024, metavar="N",
                     help="requests queued beyond the running batch before new ones are refused")
    srv.add_argument("--no-overlap", action="store_true",
                     help="plan each step only after the previous one finished on the device")
    srv.add_argument("--ws", metavar="[HOST:]PORT",
                     help="also start the websocket bridge (and its browser page) there (host: 127.0.0.1)")
    srv.add_argument("--http", metavar="[HOST:]PORT",
                     help="also start the OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                          "/metrics) there (host: 127.0.0.1)")
    srv.add_argument("--token", metavar="SECRET",
                     help="bearer token the websocket bridge and the HTTP server require (default: "
                          "$OVERLAP_BRIDGE_TOKEN; unset: no auth; empty: an error)")
    srv.add_argument("--on-failure", choices=("exit", "restart"), default="exit",
                     help="when a server process dies: exit non-zero (default) or restart the processes")
    srv.add_argument("--max-restarts", type=_positive_int, default=3, metavar="N")
    srv.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                     help="info (default) logs a line per finished request and a throughput / KV-usage "
                          "line every --stats-interval seconds while busy; warning silences both")
    srv.add_argument("--stats-interval", type=float, default=10.0, metavar="S",
                     help="seconds between throughput lines while busy (default: 10; 0: none)")
    _add_engine_options(srv)

    brg = sub.add_parser("bridge", help="websocket <-> daemon streaming bridge, with a browser page")
    brg.add_argument("--server", required=True, metavar="ADDRESS", help="the daemon's ZeroMQ address")
    brg.add_argument("--listen", default="127.0.0.1:8765", metavar="HOST:PORT",
                     help="where the bridge listens (default: 127.0.0.1:8765, loopback only)")
    brg.add_argument("--token", metavar="SECRET",
                     help="require this bearer token (default: $OVERLAP_BRIDGE_TOKEN; unset: no auth; "
                          "empty: an error)")
    brg.add_argument("--log-level", choices=LOG_LEVELS, default="info")

    http = sub.add_parser("http", help="OpenAI-compatible HTTP server <-> a running daemon")
    http.add_argument("--server", required=True, metavar="ADDRESS", help="the daemon's ZeroMQ address")
    http.add_argument("--listen", default="127.0.0.1:8000", metavar="[HOST:]PORT",
                      help="where the HTTP server listens (default: 127.0.0.1:8000, loopback only)")
    http.add_argument("--token", metavar="SECRET",
                      help="require this bearer token (default: $OVERLAP_BRIDGE_TOKEN; unset: no auth; "
                           "empty: an error)")
    http.add_argument("--timeout", type=float, default=300.0, metavar="S",
                      help="seconds to wait for each reply from the daemon (default: 300)")
    http.add_argument("--log-level", choices=LOG_LEVELS, default="info")

    conv = sub.add_parser("convert", help="convert a GGUF into an HF-style directory (cached)")
    conv.add_argument("gguf", nargs="?", metavar="GGUF", help="default: the shipped model")
    conv.add_argument("--out", metavar="DIR", help="default: the conversion cache directory")
    return parser


def engine_config(args: argparse.Namespace, spec_method: str | None = None) -> EngineConfig:
    """Config file (or defaults), then each flag the user gave on top; `spec_method` overrides
    the config's speculative method (bench builds one config per mode)."""
    if args.config:
        if not Path(args.config).is_file():
            raise FileNotFoundError(f"config file {args.config} does not exist")
        config = load_config(args.config)
    else:
        config = EngineConfig()

    def given(**kw):
        return {k: v for k, v in kw.items() if v is not None}

    config = dataclasses.replace(
        config,
        **given(model=args.model, dtype=args.dtype, tensor_parallel=args.tp, device=args.device,
                attention_backend=args.attention_backend, matmul=getattr(args, "matmul", None)),
        cache=dataclasses.replace(config.cache, **given(page_size=args.page_size, num_pages=args.num_pages,
                                                        prefix_caching=getattr(args, "prefix_caching", None))),
        scheduler=dataclasses.replace(config.scheduler, **given(
            max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens)),
        spec=dataclasses.replace(config.spec, **given(
            method=spec_method, num_spec_tokens=args.num_spec_tokens, draft_model=args.draft_model,
            head=args.head, tree_depth=args.tree_depth, tree_topk=args.tree_topk, tree_tokens=args.tree_tokens,
            draft_vocab=_head_vocab(args.draft_vocab, spec_method),
            tree=args.tree, controller=_one(getattr(args, "speculation_controller", None)),
            drafter_weights=_one(getattr(args, "drafter_weights", None)),
            lookup_branch=_one(getattr(args, "lookup_branch", None)),
            step_costs=getattr(args, "cost_curve", None))),
    )
    if config.spec.method == "eagle" and args.num_spec_tokens is not None:
        raise ValueError("--num-spec-tokens does not apply to --spec eagle: a tree step verifies --tree-tokens "
                         "nodes (shape the tree with --tree-depth, --tree-topk, --tree-tokens); in bench, give "
                         "a chain mode its own K instead (mtp:3)")
    if config.spec.draft_vocab and config.spec.method not in HEAD_METHODS:
        if isinstance(args.draft_vocab, int):
            raise ValueError(f"--draft-vocab {config.spec.draft_vocab}: give a positive N, with --spec mtp or eagle "
                             "(the draft model carries its own trimmed vocabulary)")
        # A config file's head setting (configs/smollm2-135m-mtp.toml) with another mode asked
        # for (--spec draft, or a bench's other modes): it does not apply there.
        config = dataclasses.replace(config, spec=dataclasses.replace(config.spec, draft_vocab=None))
    if config.spec.draft_vocab is not None and config.spec.draft_vocab < 0:
        raise ValueError(f"draft_vocab {config.spec.draft_vocab}: give N >= 0 (0: the full vocabulary)")
    if config.spec.lookup_branch and config.spec.method not in BRANCHED_METHODS:
        if isinstance(getattr(args, "lookup_branch", None), int):
            raise ValueError(f"--lookup-branch {config.spec.lookup_branch}: the branch is verified beside a model "
                             f"drafter's drafts: give --spec draft, mtp or eagle (--spec {config.spec.method} has "
                             "none)")
        # A config file's branch (configs/smollm2-135m-mtp.toml) with a mode that has no drafter.
        config = dataclasses.replace(config, spec=dataclasses.replace(config.spec, lookup_branch=0))
    bench_sweep = isinstance(getattr(args, "drafter_weights", None), list)  # bench: per drafting mode
    if config.spec.drafter_weights == "int8" and config.spec.method in ("none", "ngram") and not bench_sweep:
        raise ValueError(f"--drafter-weights int8: --spec {config.spec.method} has no drafter weights "
                         "(give --spec draft, mtp or eagle)")
    check_device(config.device, config.attention_backend)  # before any model loads
    if config.spec.method == "draft":
        config = dataclasses.replace(config, spec=dataclasses.replace(
            config.spec, draft_model=_draft_dir(config.model, config.spec.draft_model)))
    if config.spec.method in HEAD_METHODS:
        config = dataclasses.replace(config, spec=dataclasses.replace(
            config.spec, head=_head_dir(config.model, config.spec.head)))
    return config


def _head_vocab(value, method: str | None):
    """--draft-vocab as one engine takes it: a bench's list (one variant each) configures a head
    mode with its first size and leaves the other modes at their default (method None: the
    config's own method, e.g. --step-costs: the first size)."""
    if isinstance(value, list):
        return value[0] if method is None or method in HEAD_METHODS else None
    return value


def _one(value):
    """A bench option that takes several values (one variant each) configures with the first."""
    return value[0] if isinstance(value, list) else value


def _is_default_model(model: str | None) -> bool:
    if model is None:
        return True
    try:
        return Path(model).expanduser().resolve() == default_gguf_path().resolve()
    except ModelNotFoundError:  # the default package is not installed: `model` is not it
        return False


def _draft_dir(model: str | None, draft: str | None) -> str:
    """The draft for --spec draft: the one asked for, else the shipped one (default model only).

    Checked here, before any model loads, so a missing draft costs nothing to find out.
    """
    if draft is None and not _is_default_model(model):
        raise ValueError("--spec draft needs --draft-model for a non-default model")
    path = Path(draft).expanduser() if draft else default_draft_dir()
    if not (path / "config.json").is_file():
        if path.resolve() == default_draft_dir().resolve():  # also when a config names it
            raise FileNotFoundError(f"the shipped draft is missing at {path}; train it with tools/distill_draft.py")
        raise FileNotFoundError(f"draft model directory {path} does not exist or has no config.json")
    return str(path)


def _head_dir(model: str | None, head: str | None) -> str:
    """The MTP head for --spec mtp: the one asked for, else the shipped one (default model only)."""
    if head is None and not _is_default_model(model):
        raise ValueError("--spec mtp needs --head for a non-default model")
    path = Path(head).expanduser() if head else default_head_dir()
    if not (path / "config.json").is_file():
        if path.resolve() == default_head_dir().resolve():
            raise FileNotFoundError(f"the shipped MTP head is missing at {path}; train it with tools/train_mtp.py")
        raise FileNotFoundError(f"MTP head directory {path} does not exist or has no config.json")
    return str(path)


def make_engine(config: EngineConfig):
    """The one place the CLI builds an engine (tests substitute a cached one)."""
    from runtime.engine import Engine

    return Engine(config, progress=sys.stderr.isatty())  # no walls of \r in logs and pipes


# -- commands ------------------------------------------------------------------------------


def cmd_generate(args: argparse.Namespace) -> int:
    # 1. check the request before paying for the model load
    if not args.prompt:
        raise RequestError("prompt", "is empty")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop=list(args.stop))
    params.validate()
    if args.server:
        return _generate_on_server(args, params)
    config = engine_config(args, args.spec)
    engine = make_engine(config)
    # 2. one JSON object at the end ...
    if args.json:
        result = engine.generate([args.prompt], params, chat=args.chat)[0]
        stats = dict(result.stats)
        if stats.get("latency_s"):
            stats["tokens_per_s"] = stats["output_tokens"] / stats["latency_s"]
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "finish_reason": result.finish_reason, "stats": stats}))
        return 0
    # 3. ... or stream each delta as it arrives
    return _print_stream(engine.stream(args.prompt, params, chat=args.chat), config.spec.method)


def _print_stream(deltas, mode: str) -> int:
    """Stream the text to stdout; then one summary line on stderr: tokens, time, tok/s, TTFT,
    the speculative mode and its acceptance length (tokens per verify step), finish reason."""
    start, first, tokens, finish, last, stats = time.perf_counter(), None, 0, None, "\n", None
    for delta in deltas:
        if delta.token_ids and first is None:
            first = time.perf_counter()
        tokens += len(delta.token_ids)
        finish = delta.finish_reason
        stats = getattr(delta, "stats", None) or stats
        if delta.text:
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            last = delta.text
    if not last.endswith("\n"):
        sys.stdout.write("\n")
        sys.stdout.flush()
    elapsed = time.perf_counter() - start
    ttft = f", TTFT {(first - start) * 1e3:.0f} ms" if first else ""
    spec = f"spec {mode}"
    if mode != "none":
        acceptance = (stats or {}).get("acceptance_length")
        spec += f", acceptance length {acceptance:.2f}" if acceptance is not None else ", no drafts verified"
    print(f"[{tokens} tokens in {elapsed:.2f} s, {tokens / elapsed:.1f} tok/s{ttft}, {spec}, finish: {finish}]",
          file=sys.stderr)
    return 0


def _probe(client, timeout: float = PROBE_TIMEOUT_S) -> dict:
    """A health check with a short timeout before any request: no server there fails in a
    few seconds, while the requests themselves keep the long --timeout."""
    from runtime.client import ClientTimeout

    timeout = min(timeout, client.timeout)
    try:
        return client.health(timeout=timeout)
    except ClientTimeout:
        raise ConnectionError(f"no overlap server answered at {client.address} within {timeout:g} s "
                              "(is `overlap serve` running there?)") from None


def _connect(address: str, timeout: float):
    """A Client for --server ADDRESS; a malformed address is a one-line error."""
    import zmq

    from runtime.client import Client

    try:
        return Client(address, timeout=timeout)
    except zmq.ZMQError as e:
        raise ConnectionError(f"--server {address}: {e} (expected e.g. tcp://127.0.0.1:5557)") from None


def _server_spec(served: str, wanted: str | None) -> bool:
    """Whether requests speculate on the server: `none` turns it off per request; any other
    mode must be the one the server runs (it is fixed when the daemon starts)."""
    if wanted not in (None, "none", served):
        raise ValueError(f"the server runs --spec {served}; a request can only use it or none")
    return wanted != "none"


def _generate_on_server(args: argparse.Namespace, params: SamplingParams) -> int:
    from runtime.client import ClientTimeout, ServerError

    messages = [{"role": "user", "content": args.prompt}] if args.chat else None
    prompt = None if args.chat else args.prompt
    try:
        with _connect(args.server, args.timeout) as client:
            served = _probe(client)["spec"]
            params = msgspec.structs.replace(params, spec=_server_spec(served, args.spec))
            if args.json:
                r = client.generate(prompt, messages=messages, params=params)
                print(json.dumps({"text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason,
                                  "stats": r.stats}))
                return 0
            return _print_stream(client.stream(prompt, messages=messages, params=params),
                                 served if params.spec else "none")
    except ClientTimeout as e:
        raise ConnectionError(f"{e} (the server answered its health check, then went quiet)") from None
    except ServerError as e:
        raise RequestError(e.field or "server", e.message) from None


def cmd_bench(args: argparse.Namespace) -> int:
    from runtime.bench import format_report, load_prompts, run_bench, write_report

    if args.step_costs:
        return _bench_step_costs(args)
    if not args.prompts:
        raise ValueError("bench needs --prompts FILE.jsonl (e.g. benchmarks/prompts/code.jsonl), or --step-costs")
    if args.max_tokens <= 0:
        raise RequestError("max_tokens", f"must be > 0, got {args.max_tokens}")
    prompts = load_prompts(args.prompts, args.num_prompts)
    # One (label, config) per mode, in the order given but with "none" first: the first
    # variant is the baseline for speedups and for the identical-outputs check.
    variants = _bench_variants(args)
    report = run_bench(variants, prompts, args.max_tokens, args.concurrency, compare_hf=args.compare_hf,
                       make_engine=make_engine, shared_prefix=args.shared_prefix or 0, rounds=args.rounds,
                       interleave=args.interleave)
    print(format_report(report))
    if args.json:
        write_report(report, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        from runtime.bench_plot import plot_report

        plot_report(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _bench_step_costs(args: argparse.Namespace) -> int:
    from overlap.config import torch_dtype
    from overlap.models.llama import load_llama
    from overlap.models.loading import resolve_model_dir
    from runtime import step_costs

    if len(args.draft_vocab or []) > 1:
        raise ValueError("--step-costs measures one draft vocabulary: give one --draft-vocab N")
    config = engine_config(args, None)
    model = load_llama(resolve_model_dir(config.model, progress=True), torch_dtype(config.dtype),
                       config.device, config.matmul)
    report = step_costs.measure(model, config, context=args.context,
                                head_dir=config.spec.head, draft_dir=config.spec.draft_model,
                                progress=lambda line: print(line, file=sys.stderr, flush=True))
    report["matmul"], report["attention_backend"] = config.matmul, config.attention_backend
    print(step_costs.format_report(report))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot:
        step_costs.plot(report, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from runtime.daemon import DaemonError, serve

    config = engine_config(args, args.spec)
    if args.no_overlap:
        config = dataclasses.replace(config, overlap=False)
    ws = args.ws if args.ws is None or ":" in args.ws else f"127.0.0.1:{args.ws}"
    http = None
    if args.http:
        from runtime.http_server import parse_listen as parse_http

        http = "{}:{}".format(*parse_http(args.http))  # a bad value fails here, before any model loads
    token = None
    if ws or http:
        from runtime.ws_bridge import parse_listen, resolve_token

        if ws:
            parse_listen(ws)  # a bad value fails here, before any model loads
        token = resolve_token(args.token)  # so does an empty token
    elif args.token is not None:
        raise ValueError("--token is for the websocket bridge and the HTTP server: give --ws or --http too")
    # serve() checks every listen address (--zmq, --ws, --http) before it loads anything.
    try:
        return serve(config, args.zmq, max_waiting=args.max_waiting, ws_listen=ws, ws_token=token,
                     http_listen=http, http_token=token,
                     on_failure=args.on_failure, max_restarts=args.max_restarts, log_level=args.log_level,
                     stats_interval_s=args.stats_interval)
    except DaemonError as e:
        print(f"overlap: error: {' '.join(str(e).splitlines())}", file=sys.stderr)
        return EXIT_FAILURE


def cmd_bridge(args: argparse.Namespace) -> int:
    import logging

    import uvloop

    from runtime.ipc import check_listen
    from runtime.ws_bridge import parse_listen, resolve_token, run_bridge

    host, port = parse_listen(args.listen)
    token = resolve_token(args.token)
    check_listen({"--listen": args.listen})
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s bridge %(levelname)s %(message)s")
    try:
        uvloop.run(run_bridge(args.server, host, port, token))
    except OSError as e:
        raise ConnectionError(f"cannot listen on {args.listen}: {e.strerror or e}") from None
    return 0


def cmd_http(args: argparse.Namespace) -> int:
    import logging

    import uvloop

    from runtime.http_server import parse_listen, run_http
    from runtime.ipc import check_listen
    from runtime.ws_bridge import resolve_token

    host, port = parse_listen(args.listen)
    token = resolve_token(args.token)
    check_listen({"--listen": f"{host}:{port}"})
    with _connect(args.server, args.timeout) as client:
        _probe(client)  # no daemon there: one line in seconds, not a server that answers 503
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s http %(levelname)s %(message)s")
    uvloop.run(run_http(args.server, host, port, token, timeout=args.timeout))
    return 0


def _bench_variants(args: argparse.Namespace) -> list:
    """One Variant per mode (none first: it is the baseline for speedups and the identical-
    outputs check); in-process, with overlap off too (--no-overlap), and/or on the server."""
    from runtime.bench import Variant

    if args.compare_inprocess and not args.server:
        raise ValueError("--compare-inprocess needs --server")
    if args.server:
        with _connect(args.server, 30) as client:
            served = _probe(client)["spec"]
        modes = list(dict.fromkeys(args.spec or [served]))
        bad = [m for m in modes if m.partition(":")[0] not in ("none", served)]
        if bad:
            raise ValueError(f"the server runs --spec {served}; --spec {' '.join(bad)} cannot be benchmarked on it")
    else:
        modes = list(dict.fromkeys(args.spec or [engine_config(args).spec.method]))
    modes.sort(key=lambda m: m != "none")
    if args.draft_vocab and not any(m.partition(":")[0] in HEAD_METHODS for m in modes):
        raise ValueError(f"--draft-vocab {' '.join(map(str, args.draft_vocab))}: the head's draft vocabulary "
                         f"applies to --spec mtp or eagle, and none is benchmarked ({' '.join(modes)})")
    variants = []
    if not args.server or args.compare_inprocess:
        for mode in modes:
            method, _, k = mode.partition(":")
            config = engine_config(args, method)
            if k in ("static", "dynamic"):
                config = dataclasses.replace(config, spec=dataclasses.replace(config.spec, tree=k))
            elif k and method == "eagle":  # eagle:N, a tree of N nodes
                config = dataclasses.replace(config, spec=dataclasses.replace(config.spec, tree_tokens=int(k)))
            elif k:
                config = dataclasses.replace(config, spec=dataclasses.replace(config.spec, num_spec_tokens=int(k)))
            controllers = list(dict.fromkeys(args.speculation_controller or [config.spec.controller]))
            weights = list(dict.fromkeys(args.drafter_weights or [config.spec.drafter_weights]))
            lookups = list(dict.fromkeys(args.lookup_branch or [config.spec.lookup_branch]))
            drafts = method in BRANCHED_METHODS  # the model drafters: weights and a lookup branch
            heads = method in HEAD_METHODS  # a draft vocabulary
            vocabs = list(dict.fromkeys(args.draft_vocab or [config.spec.draft_vocab]))
            for ctl, wts, lookup, vocab in itertools.product(
                    controllers if method != "none" else [config.spec.controller],
                    weights if drafts else [SpecConfig().drafter_weights], lookups if drafts else [0],
                    vocabs if heads else [config.spec.draft_vocab]):
                label = mode
                if len(controllers) > 1 and method != "none":
                    label += f" controller={ctl}"
                if len(weights) > 1 and drafts:
                    label += f" {wts}"
                if lookup:  # 0 for the modes without a model drafter
                    label += f" lookup={lookup}"
                if len(vocabs) > 1 and heads:
                    label += f" vocab={vocab}"
                variants.append(Variant(label, dataclasses.replace(config, spec=dataclasses.replace(
                    config.spec, controller=ctl, drafter_weights=wts, lookup_branch=lookup, draft_vocab=vocab))))
                if method == "none" and args.aa:
                    # The same engine twice: what "1.00x" looks like on this machine today.
                    variants.append(Variant("none A/A", variants[-1].config))
                if args.shared_prefix and config.cache.prefix_caching:
                    last = variants[-1]
                    variants.append(Variant(f"{label} no-prefix-cache", dataclasses.replace(
                        last.config, cache=dataclasses.replace(config.cache, prefix_caching=False))))
            config = variants[-1].config
            if args.no_overlap:
                variants.append(Variant(f"{mode} no-overlap", dataclasses.replace(config, overlap=False)))
            for tp in args.compare_tp or []:
                if tp != config.tensor_parallel:
                    variants.append(Variant(f"{mode} tp={tp}", dataclasses.replace(config, tensor_parallel=tp)))
    if (args.http or args.scrape_metrics) and not args.server:
        raise ValueError("--http and --scrape-metrics need --server (the daemon the HTTP server talks to)")
    if args.scrape_metrics and not args.http:
        raise ValueError("--scrape-metrics needs --http URL")
    if args.server:
        # The server's own config decides its engine; ours only names the model for tokenizing.
        served = [mode for mode in modes if ":" not in mode]
        config = engine_config(args, None)
        variants += [Variant(f"{mode} @server", config, args.server, mode != "none") for mode in served]
        token = args.http_token or os.environ.get("OVERLAP_BRIDGE_TOKEN")
        for mode in served if args.http else []:
            variants.append(Variant(f"{mode} @http", config, args.server, mode != "none", args.http, token))
            if args.scrape_metrics:
                variants.append(Variant(f"{mode} @http +metrics/{args.scrape_metrics:g}s", config, args.server,
                                        mode != "none", args.http, token, args.scrape_metrics))
    return variants


def cmd_convert(args: argparse.Namespace) -> int:
    from overlap.models.loading import cache_dir_for, convert_gguf, default_gguf_path

    gguf = Path(args.gguf).expanduser() if args.gguf else default_gguf_path()
    if not gguf.is_file():
        raise ModelNotFoundError(f"GGUF file {gguf} does not exist")
    if gguf.suffix.lower() != ".gguf":
        raise ModelNotFoundError(f"{gguf} is not a .gguf file")
    if args.out:
        out = Path(args.out).expanduser()
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ValueError(f"--out {out} already exists and is not an empty directory")
    else:
        out = cache_dir_for(gguf)
        if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
            print(out)  # already converted: the cache key covers the file's size and mtime
            return 0
    print(convert_gguf(gguf, out, progress=sys.stderr.isatty()))
    return 0


COMMANDS = {"generate": cmd_generate, "bench": cmd_bench, "serve": cmd_serve, "bridge": cmd_bridge,
            "http": cmd_http, "convert": cmd_convert}


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help (0) or a usage error (2, already reported)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return COMMANDS[args.command](args)
    except (RequestError, ModelNotFoundError, ValueError, FileNotFoundError, ConnectionError) as e:
        message = " ".join(str(e).splitlines())
        print(f"overlap: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("overlap: interrupted", file=sys.stderr)
        return 130


def main_entry() -> None:
    sys.exit(main())


if __name__ == "__main__":
    main_entry()
