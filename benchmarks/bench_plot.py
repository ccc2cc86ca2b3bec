"""bench.py --plot: throughput against p95 latency per concurrency level, and the mixed probe's timeline (with
--mixed-probe)."""


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report.get("runs", {})
    probed = any(run.get("mixed") for run in runs.values())
    fig, axes = plt.subplots(1, 2 if probed else 1, figsize=(14 if probed else 7, 5), squeeze=False)
    curve, row = axes[0][0], 0
    for label, run in runs.items():
        for key, style in (("p95_itl_ms", "-o"), ("p95_ttft_ms", "--s")):
            pts = [
                (lv["metrics"]["output_throughput"], lv["metrics"][key], lv["concurrency"])
                for lv in run["sweep"]
                if lv["metrics"][key] is not None
            ]
            if pts:
                curve.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{label} {key[4:-3].upper()}")
                for x, y, c in pts:
                    curve.annotate(f"{c} client{'s' if c > 1 else ''}", (x, y), fontsize=8)
        for r in (run.get("mixed") or {}).get("requests", []):
            timeline = axes[0][1]
            end = r["end"] if r["end"] is not None else run["mixed"]["duration_s"]
            timeline.hlines(row, r["start"], end, colors="tab:blue" if r["group"] == "short" else "tab:red")
            if r["ttft"] is not None:
                timeline.plot(r["start"] + r["ttft"], row, "k|")
            row += 1
        if run.get("mixed"):
            axes[0][1].text(0, row, f"{label} (red: long, blue: short, |: first token)", fontsize=8)
            row += 2
    curve.set(
        xlabel="Output token throughput (tok/s)",
        ylabel="P95 latency (ms)",
        yscale="log",
        title="Throughput vs p95 latency per concurrency level",
    )
    curve.legend()
    if probed:
        axes[0][1].set(xlabel="seconds", ylabel="request", title="Mixed probe timeline", ylim=(-1, row))  # labels in
    fig.tight_layout()
    fig.savefig(path, dpi=120)
