"""The grading replay's timeline (PNG): one row per request, its queued, prefill, KV and decode segments on the
client's clock; a panel per run (the split, and Mac-alone beside it when measured), on one time axis."""

from __future__ import annotations

COLORS = {"queued": "#bbbbbb", "prefill": "#1f77b4", "kv": "#ff7f0e", "decode": "#2ca02c"}
LABELS = {"queued": "queued (gateway)", "prefill": "prefill (Spark, or the Mac on the local path)",
          "kv": "KV transfer + first token", "decode": "decode (Mac)"}


def timeline(runs: list[tuple[str, list[dict], dict | None]], path: str) -> str:
    """`runs`: (title, result rows with `segments`, predicted summary or None) each; writes `path`, returns it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(len(r) for _, r, _ in runs)
    fig, axes = plt.subplots(1, len(runs), figsize=(max(9, 7 * len(runs)), 1.6 + 0.22 * rows), sharex=True,
                             squeeze=False)
    end = max([row["end"] for _, r, _ in runs for row in r] + [p["makespan_s"] for _, _, p in runs if p] or [1.0])
    for ax, (title, results, predicted) in zip(axes[0], runs):
        for y, row in enumerate(results):
            for name, (a, b) in (row.get("segments") or {}).items():
                if b > a:
                    ax.broken_barh([(a, b - a)], (y - 0.4, 0.8), color=COLORS[name])
            if row.get("error"):
                ax.broken_barh([(row["start"], row["end"] - row["start"])], (y - 0.4, 0.8), color="#d62728")
        labels = [f"s{row['submission']:02d} {row['model'].split(':')[0][:10]} {row.get('node') or '-'}"
                  for row in results]
        ax.set_yticks(range(len(results)), labels, fontsize=6)
        ax.invert_yaxis()
        measured = max((row["end"] for row in results), default=0.0)
        sub = f"measured {measured:.0f} s"
        if predicted:
            ax.axvline(predicted["makespan_s"], color="black", linestyle="--", linewidth=1)
            sub += f", predicted {predicted['makespan_s']:.0f} s (dashed)"
        ax.set_title(f"{title}: {sub}", fontsize=9)
        ax.set_xlabel("seconds since the class started")
        ax.set_xlim(0, end * 1.02)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    fig.legend(handles, LABELS.values(), loc="lower center", ncol=2, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 1.0 / (1.6 + 0.22 * rows), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
