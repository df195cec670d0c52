"""Plot accuracy against training time from time_to_accuracy.py result lines (JSON, one per run).

    python benchmarks/plot_tta.py benchmarks/results/tta_100mbit.jsonl benchmarks/results/tta_100mbit.png --title "100 Mbit/s link"
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results")
    p.add_argument("out")
    p.add_argument("--title", default="")
    p.add_argument("--target", type=float, default=0.985)
    args = p.parse_args()
    fig, ax = plt.subplots(figsize=(6, 4))
    with open(args.results) as f:
        for line in f:
            run = json.loads(line)
            label = run["option"] + (f" (spars {run['spars']})" if run.get("spars") else "")
            _, seconds, acc = zip(*run["curve"])
            ax.plot(seconds, acc, marker="o", markersize=3, label=label)
    ax.axhline(args.target, color="grey", linestyle="--", linewidth=1, label=f"target {args.target}")
    ax.set_xlabel("training time (s, evaluation excluded)")
    ax.set_ylabel("MNIST evaluation accuracy")
    ax.set_ylim(0.95, 0.995)
    ax.set_title(f"Time to accuracy, 2 ranks, {args.title}".rstrip(", "))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
