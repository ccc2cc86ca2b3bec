"""bench.py --plot: throughput against p95 latency per concurrency level, and the mixed probe's timeline."""


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (curve, timeline) = plt.subplots(1, 2, figsize=(14, 5))
    row = 0
    for label, run in report.get("runs", {}).items():
        for key, style in (("p95_itl_ms", "-o"), ("p95_ttft_ms", "--s")):
            pts = [(lv["metrics"]["output_throughput"], lv["metrics"][key], lv["concurrency"]) for lv in run["sweep"]
                   if lv["metrics"][key] is not None]
            if pts:
                curve.plot([p[0] for p in pts], [p[1] for p in pts], style, label=f"{label} {key[4:-3].upper()}")
                for x, y, c in pts:
                    curve.annotate(f"c={c}", (x, y), fontsize=8)
        for r in (run.get("mixed") or {}).get("requests", []):
            end = r["end"] if r["end"] is not None else run["mixed"]["duration_s"]
            timeline.hlines(row, r["start"], end, colors="tab:blue" if r["group"] == "short" else "tab:red")
            if r["ttft"] is not None:
                timeline.plot(r["start"] + r["ttft"], row, "k|")
            row += 1
        if run.get("mixed"):
            timeline.text(0, row, f"{label} (red: long, blue: short, |: first token)", fontsize=8)
            row += 2
    curve.set(xlabel="Output token throughput (tok/s)", ylabel="P95 latency (ms)", yscale="log",
              title="Throughput vs p95 latency per concurrency level")
    curve.legend()
    timeline.set(xlabel="seconds", ylabel="request", title="Mixed probe timeline")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
