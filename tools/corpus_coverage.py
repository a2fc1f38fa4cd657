"""How much of the corpus (tests/corpus) the passes rewrite: matches per model and pass.

    python tools/corpus_coverage.py                  # print the table (CPU, aot_eager, fp32)
    python tools/corpus_coverage.py --update         # also rewrite tests/corpus/coverage.json
    python tools/corpus_coverage.py paper_bhsd.py    # only these models (--update merges them)

Each model is optimized (`compiler="aot_eager"`) and run forward and backward on its factory's
inputs; the counts are `nsa_compile.report(model)`'s matches. tests/test_corpus.py asserts them
against coverage.json exactly, so a pass that starts (or stops) recognizing a corpus model shows
up as a test failure until coverage.json is updated with this script.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch
from tabulate import tabulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import nsa_compile  # noqa: E402
from corpus import HERE, MODELS, spec  # noqa: E402
from nsa_compile.workload import load_workload, loss_of  # noqa: E402

COVERAGE_FILE = HERE / "coverage.json"


def coverage_of(model) -> dict[str, int]:
    """{pass name: matches} of an optimized model that has run."""
    return {row["name"]: row["matches"] for row in nsa_compile.report(model)}


def measure(name: str) -> dict[str, int]:
    """Optimize one corpus model (aot_eager), run forward and backward, and count the matches."""
    wl = load_workload(spec(name))
    torch._dynamo.reset()
    model = nsa_compile.optimize(copy.deepcopy(wl.model), nsa_compile.OptimizeConfig(compiler="aot_eager"))
    _, loss = loss_of(model, wl.inputs, is_lm=False)
    loss.backward()
    return coverage_of(model)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="corpus file names (default: all)")
    parser.add_argument("--update", action="store_true", help=f"write the counts to {COVERAGE_FILE}")
    args = parser.parse_args(argv)
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown corpus model(s) {', '.join(unknown)}; valid: {', '.join(MODELS)}")
    counts, failures = {}, {}
    for name in args.models or MODELS:
        try:
            counts[name] = measure(name)
        except Exception as err:  # a pass that breaks a model: report it, keep its stored counts
            failures[name] = f"{type(err).__name__}: {(str(err).strip().splitlines() or [''])[0]}"
    passes = list(dict.fromkeys(p for row in counts.values() for p in row))
    table = [[name, *(row.get(p, "-") for p in passes), sum(row.values())] for name, row in counts.items()]
    print(tabulate(table, headers=["model", *passes, "total"], tablefmt="github"))
    for name, error in failures.items():
        print(f"{name}: optimize failed: {error}")
    if args.update:
        stored = json.loads(COVERAGE_FILE.read_text()) if COVERAGE_FILE.exists() else {}
        stored.update(counts)
        ordered = {name: stored[name] for name in MODELS if name in stored}  # corpus order; removed files drop out
        COVERAGE_FILE.write_text(json.dumps(ordered, indent=2) + "\n")
        print(f"wrote {COVERAGE_FILE}" + (f" (kept the stored counts of {', '.join(failures)})" if failures else ""))
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
