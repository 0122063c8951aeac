"""Plots of an `overlap bench` report (`--plot OUT.png`): a table of every mode x concurrency
x position is unreadable past a few rows.

Left: tokens/s against concurrency, one line per mode (speedups over the first mode are
the ratios of these lines); a mode run with the speculation controller off is dashed. Right: acceptance per draft position (the share of steps whose
draft at that depth was accepted), one line per speculative mode at the lowest concurrency.
"""

from __future__ import annotations

from pathlib import Path


def plot_report(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, accept) = plt.subplots(1, 2, figsize=(11, 4.2))
    # One colour per mode: with the controller on and off side by side ("mtp" and "mtp
    # controller=off"), the off line is the same colour, dashed.
    colours: dict[str, str] = {}
    for i, v in enumerate(report["variants"]):
        mode = v["label"].split()[0]
        colour = colours.setdefault(mode, f"C{len(colours)}")
        style = "o--" if "controller=off" in v["label"] else "o-"
        runs = sorted(v["runs"], key=lambda r: r["concurrency"])
        speed.plot([r["concurrency"] for r in runs], [r["tokens_per_s"] for r in runs], style,
                   color=colour, label=v["label"])
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
    fig.suptitle(f"{cfg['num_prompts']} prompts x {cfg['max_tokens']} tokens, {cfg['threads']} threads", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
