"""Render bench_sdpa.py results (JSON) as markdown, and optionally write them into README.md
between the markers `<!-- bench:begin -->` and `<!-- bench:end -->` (the README's performance
table is always this script's output, never typed by hand). Also draws each file's figures
(bench/plotting.py: speedup over PyTorch, % of the measured peak) as PNGs into --plots, by
default the first file's directory, and links them under their tables.

    python bench/report.py bench/results/fwd.json [more.json ...] [--readme README.md]
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hf import markdown as hf_markdown  # noqa: E402
from bench_paths import markdown as paths_markdown  # noqa: E402
from bench_sdpa import markdown  # noqa: E402
from bench_serving import markdown as serving_markdown  # noqa: E402
from bench_variants import markdown as variants_markdown  # noqa: E402
from plotting import plot_results  # noqa: E402

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
TITLES = {"fwd": "Forward", "train": "Forward + backward", "decode": "Decode (q_len = 1)",
          "paths": "Special paths, each against its alternative",
          "variants": "Attention variants (window, softcap, ALiBi, sinks)",
          "serving": "Serving: KV-cache decode and prefill, paged caches, varlen batches",
          "hf": "Hugging Face transformers models (attn_implementation=\"fused_attention\")"}
RENDER = {"paths": paths_markdown, "variants": variants_markdown, "serving": serving_markdown,
          "hf": hf_markdown}


def render(paths, plots=None, base="."):
    """Markdown for each results file: heading, table, then its figures (when `plots`, a
    directory, is given), linked relative to `base`, the directory of the README they go in."""
    parts = []
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        meta = res["meta"]
        title = TITLES.get(meta["mode"], meta["mode"])
        if meta.get("cap_isa"):  # bench_sdpa.py --cap-isa
            title += f", PyTorch and flashsdpa both held to {meta['cap_isa'].upper()}"
        elif meta.get("torch_cpu_capability") == "AVX2":  # uncapped: a host without AVX-512
            title += ", on an AVX2-only host"
        parts.append(f"#### {title} (`{os.path.relpath(path)}`, {meta['date']})\n")
        parts.append(RENDER.get(meta["mode"], markdown)(meta, res["rows"]))
        parts.append("")
        for png in plot_results(path, meta, res["rows"], plots) if plots else []:
            figure = os.path.splitext(os.path.basename(png))[0].rsplit("_", 1)[1]
            parts.append(f"![{title}: {figure}]({os.path.relpath(png, base)})\n")
    return "\n".join(parts)


def update_readme(readme, text):
    with open(readme) as f:
        content = f.read()
    if BEGIN not in content or END not in content:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} section")
    head, rest = content.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    with open(readme, "w") as f:
        f.write(head + BEGIN + "\n" + text + "\n" + END + tail)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--readme", help="write the tables into this README")
    ap.add_argument("--plots", metavar="DIR",
                    help="write the PNG figures here (default: the first file's directory; "
                         "'' for none)")
    args = ap.parse_args(argv)
    plots = (os.path.dirname(args.results[0]) or ".") if args.plots is None else args.plots
    base = os.path.dirname(os.path.abspath(args.readme)) if args.readme else "."
    text = render(args.results, plots, base)
    if args.readme:
        update_readme(args.readme, text)
        print(f"updated {args.readme}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
