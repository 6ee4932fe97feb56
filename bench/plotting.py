"""PNG plots of bench results: the one place that imports matplotlib (optional: without it the
benches and report.py print their tables and skip the plots) and draws grouped bars.

    plot_results(path, meta, rows, out_dir) -> [png, ...]   # what report.py --plots writes
"""
import os

# README width: 10 x 4 inches at 100 dpi is 1000 x 400 px, a few tens of kB per figure.
FIGSIZE, DPI = (10, 4), 100
# Speedups spanning more than this factor (serving: 0.5x to 110x) get a log axis, else the
# small ratios, the ones the tables argue about, would be flat bars next to the 1.0 line.
LOG_SPAN = 20
# Peers that are PyTorch's own ways to compute the same attention; the other keys of a
# `speedup` dict compare flashsdpa with itself (paged, fp8) or with a Python loop.
TORCH_PEERS = ("torch", "flex", "eager")
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend (no display on bench machines), or None
    after saying why no plot comes."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    return plt


def grouped_bars(ax, groups, series, ylabel, ref=None, log_ok=False):
    """One group of bars per label in `groups`, one bar per series in each group, a line at
    `ref`, a log axis if `log_ok` and the values span more than LOG_SPAN.
    series: {name: [value or None per group]} (None: that series has no such case)."""
    width = 0.8 / max(len(series), 1)
    for i, (name, ys) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, y in enumerate(ys) if y is not None]
        ax.bar(xs, [y for y in ys if y is not None], width, label=name)
    if ref is not None:
        ax.axhline(ref, color="black", linewidth=0.8)
    vals = [y for ys in series.values() for y in ys if y]
    if log_ok and vals and max(vals) / min(vals) > LOG_SPAN:
        ax.set_yscale("log")
    else:
        ax.set_ylim(top=ax.get_ylim()[1] * 1.15)  # headroom: the legend sits above the bars
    ax.set_xticks(range(len(groups)), groups, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=7, ncol=min(len(series), 4))


def machine(meta):
    """Where the numbers come from, for a figure's title."""
    where = meta.get("gpu") if meta.get("device") == "cuda" else meta.get("cpu")
    threads = f", {meta['threads']} threads" if meta.get("threads") else ""
    return f"{where or 'unknown machine'}{threads}, torch {meta.get('torch', '?')}"


def shape_label(r):
    """bench_sdpa's case: B x heads (q/kv) x Lq/S x D, causal or not."""
    heads = r["Hq"] if r["Hq"] == r["Hkv"] else f"{r['Hq']}/{r['Hkv']}"
    lens = r["S"] if r["Lq"] == r["S"] else f"{r['Lq']}/{r['S']}"
    return f"B{r['B']} H{heads}\nL{lens} D{r['D']}" + ("\ncausal" if r["causal"] else "")


def sdpa_series(rows, field, keep):
    """bench_sdpa rows -> (shape labels, {provider dtype: [row[field] per shape]}) for the
    providers `keep` accepts; the provider is named only where several are kept (hw_*.json)."""
    rows = [r for r in rows if keep(r["provider"]) and r.get(field) is not None]
    labels = list(dict.fromkeys(shape_label(r) for r in rows))
    several = len({r["provider"] for r in rows}) > 1
    series = {}
    for r in rows:
        name = (f"{r['provider']} " if several else "") + SHORT.get(r["dtype"], r["dtype"])
        ys = series.setdefault(name, [None] * len(labels))
        ys[labels.index(shape_label(r))] = r[field]
    return labels, series


def dict_series(rows):
    """bench_serving / bench_variants rows (a `speedup` dict per case) -> (case labels,
    {over peer, dtype: [speedup per case]}) for PyTorch's peers only."""
    def label(r):
        return r["case"] + (f"\n{r['mode']}" if r.get("mode") else "")
    labels = list(dict.fromkeys(label(r) for r in rows))
    series = {}
    for r in rows:
        for peer, x in r["speedup"].items():
            if peer.startswith(TORCH_PEERS):
                name = f"over {peer}, {SHORT.get(r['dtype'], r['dtype'])}"
                series.setdefault(name, [None] * len(labels))[labels.index(label(r))] = x
    return labels, series


def figures(meta, rows):
    """(name, title, ylabel, reference line, labels, series) for each figure the rows support:
    speedup over PyTorch wherever recorded; fraction of the measured peak where recorded."""
    mode, where = meta.get("mode"), machine(meta)
    out = []
    if rows and "provider" in rows[0]:
        field = next((k for k in rows[0] if k.startswith("speedup_vs_")), None)
        peer = field[len("speedup_vs_"):] if field else None
        if field:
            labels, series = sdpa_series(rows, field, lambda p: p != peer)
            out.append(("speedup", f"{mode}: flashsdpa speedup over {peer} ({where})",
                        f"speedup over {peer} (x)", 1.0, labels, series))
        labels, series = sdpa_series(rows, "frac_peak", lambda p: True)
        if any(y is not None for ys in series.values() for y in ys):
            series = {k: [None if y is None else 100 * y for y in ys] for k, ys in series.items()}
            what = ("probed read bandwidth" if mode == "decode"
                    else "measured compute peak (bf16: dot-product peak)")
            out.append(("peak", f"{mode}: % of {what} (bench/peak.py; {where})",
                        f"% of {what.split(' (')[0]}", 100.0, labels, series))
    elif rows and isinstance(rows[0].get("speedup"), dict) and mode != "hf":
        # hf.json has its own figure (bench_hf.plot -> hf.png), drawn when it is measured.
        labels, series = dict_series(rows)
        if series:
            out.append(("speedup", f"{mode}: flashsdpa speedup over PyTorch ({where})",
                        "speedup (x)", 1.0, labels, series))
    return out


def plot_results(path, meta, rows, out_dir):
    """Write <stem>_<figure>.png into out_dir for each figure of the results file `path`;
    returns the PNG paths (none without matplotlib or without plottable fields)."""
    figs = figures(meta, rows)
    plt = pyplot() if figs else None
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.splitext(os.path.basename(path))[0]
    pngs = []
    for name, title, ylabel, ref, labels, series in figs:
        fig, ax = plt.subplots(figsize=FIGSIZE)
        # Percentages of a peak stay linear: the question there is how close to 100.
        grouped_bars(ax, labels, series, ylabel, ref, log_ok=name == "speedup")
        ax.set_title(title, fontsize=9)
        fig.tight_layout()
        png = os.path.join(out_dir, f"{stem}_{name}.png")
        fig.savefig(png, dpi=DPI)
        plt.close(fig)
        pngs.append(png)
    return pngs
