"""Render bench_sdpa.py results (JSON) as markdown, and optionally write them into README.md
between the markers `<!-- bench:begin -->` and `<!-- bench:end -->` (the README's performance
table is always this script's output, never typed by hand).

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

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
TITLES = {"fwd": "Forward", "train": "Forward + backward", "decode": "Decode (q_len = 1)",
          "paths": "Special paths, each against its alternative",
          "variants": "Attention variants (window, softcap, ALiBi, sinks)",
          "serving": "Serving: KV-cache decode and prefill, paged caches, varlen batches",
          "hf": "Hugging Face transformers models (attn_implementation=\"fused_attention\")"}
RENDER = {"paths": paths_markdown, "variants": variants_markdown, "serving": serving_markdown,
          "hf": hf_markdown}


def render(paths):
    parts = []
    for path in paths:
        with open(path) as f:
            res = json.load(f)
        meta = res["meta"]
        parts.append(f"#### {TITLES.get(meta['mode'], meta['mode'])} "
                     f"(`{os.path.relpath(path)}`, {meta['date']})\n")
        parts.append(RENDER.get(meta["mode"], markdown)(meta, res["rows"]))
        parts.append("")
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
    args = ap.parse_args(argv)
    text = render(args.results)
    if args.readme:
        update_readme(args.readme, text)
        print(f"updated {args.readme}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
