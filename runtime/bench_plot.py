"""Plots of an `overlap bench` report (`--plot OUT.png`): a table of every mode x concurrency
x position is unreadable past a few rows.

Left: tokens/s against concurrency, one line per mode (speedups over the first mode are
the ratios of these lines; with --rounds, the median round, bars spanning every round); a
mode run with the speculation controller off is dashed. Middle: acceptance per draft position (the share of steps whose
draft at that depth was accepted), one line per speculative mode at the lowest concurrency.
Right, when the run compared the prefix cache on and off (`--shared-prefix N`): TTFT p50 of
each mode and concurrency with the cache and without, on prompts that share N tokens.
"""

from __future__ import annotations

from pathlib import Path

from runtime.bench import ttft_with_and_without_cache


def plot_report(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = ttft_with_and_without_cache(report)
    fig, axes = plt.subplots(1, 3 if pairs else 2, figsize=(16.5 if pairs else 11, 4.2))
    speed, accept = axes[0], axes[1]
    if pairs:
        _plot_ttft(axes[2], pairs, report["config"].get("shared_prefix_tokens"))
    # One colour per mode: with the controller on and off side by side ("mtp" and "mtp
    # controller=off"), the off line is the same colour, dashed.
    colours: dict[str, str] = {}
    for i, v in enumerate(report["variants"]):
        mode = v["label"].split()[0]
        colour = colours.setdefault(mode, f"C{len(colours)}")
        style = "o--" if "controller=off" in v["label"] else "o-"
        runs = sorted(v["runs"], key=lambda r: r["concurrency"])
        xs, ys = [r["concurrency"] for r in runs], [r["tokens_per_s"] for r in runs]
        speed.plot(xs, ys, style, color=colour, label=v["label"])
        if all(len(r.get("rounds_tokens_per_s") or []) > 1 for r in runs):  # --rounds: each round's spread
            lo = [y - min(r["rounds_tokens_per_s"]) for y, r in zip(ys, runs)]
            hi = [max(r["rounds_tokens_per_s"]) - y for y, r in zip(ys, runs)]
            speed.errorbar(xs, ys, yerr=[lo, hi], fmt="none", ecolor=colour, capsize=3, alpha=0.7)
        per_pos = runs[0].get("acceptance_per_position")
        if per_pos:
            accept.plot(range(1, len(per_pos) + 1), per_pos, style, color=colour,
                        label=f"{v['label']} (acc. length {runs[0]['acceptance_length']:.2f})")
    concurrencies = report["config"]["concurrency"]
    speed.set_xscale("log", base=2)
    speed.set_xticks(concurrencies, [str(c) for c in concurrencies])
    speed.set_xlabel("concurrency (requests in flight)")
    speed.set_ylabel("output tokens/s")
    speed.set_ylim(bottom=0)
    speed.set_title("throughput")
    accept.xaxis.get_major_locator().set_params(integer=True)
    accept.set_xlabel("draft position")
    accept.set_ylabel("accepted share")
    accept.set_ylim(0, 1)
    accept.set_title(f"acceptance per position (concurrency {min(concurrencies)})")
    for ax in (speed, accept):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    cfg = report["config"]
    shared = f", each behind a shared prefix of {cfg['shared_prefix_tokens']} tokens" if cfg.get("shared_prefix_tokens") else ""
    fig.suptitle(f"{cfg['num_prompts']} prompts x {cfg['max_tokens']} tokens{shared}, {cfg['threads']} threads",
                 fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_ttft(ax, pairs: list[dict], shared: int | None) -> None:
    """Grouped bars: for each (mode, concurrency), TTFT p50 with the prefix cache and without."""
    xs = range(len(pairs))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], [p["ttft_p50_ms_uncached"] for p in pairs], width, color="C7",
           label="prefix cache off")
    ax.bar([x + width / 2 for x in xs], [p["ttft_p50_ms_cached"] for p in pairs], width, color="C2",
           label="prefix cache on")
    for x, p in zip(xs, pairs):
        ax.annotate(f"{p['ratio']:.1f}x", (x + width / 2, p["ttft_p50_ms_cached"]), ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks(list(xs), [f"{p['mode']}\nc={p['concurrency']}" for p in pairs], fontsize=8)
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"TTFT, prompts sharing {shared} tokens" if shared else "TTFT with and without the prefix cache")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
