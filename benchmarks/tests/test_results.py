"""``benchmarks/results/`` holds only what the docs cite: every entry (file or folder) is named in
README.md or a page of docs/, and its index (``results/README.md``) names every entry; no patch
files."""

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def named(name: str, text: str) -> bool:
    return re.search(r"(?<![\w.-])" + re.escape(name) + r"(?![\w-])", text) is not None


def test_every_result_is_cited_by_the_docs_and_indexed():
    pages = [os.path.join(ROOT, "README.md")] + [os.path.join(ROOT, "docs", p)
                                                 for p in sorted(os.listdir(os.path.join(ROOT, "docs")))
                                                 if p.endswith(".md")]
    docs = "\n".join(open(p).read() for p in pages)
    with open(os.path.join(RESULTS, "README.md")) as f:
        index = f.read()
    entries = [e for e in sorted(os.listdir(RESULTS)) if e != "README.md"]
    patches = [e for e in entries if e.endswith(".patch")]
    uncited = [e for e in entries if not named(e, docs)]
    unindexed = [e for e in entries if not named(e, index)]
    assert not patches, f"patch files: {patches}"
    assert not uncited, f"results no page of the docs cites (remove them): {uncited}"
    assert not unindexed, f"results benchmarks/results/README.md leaves out: {unindexed}"
