"""What did the selection do, per example? The analysis of a benchmark folder, after the fact.

From the arrays a benchmark run keeps with ``keep_outputs`` (the ``analysis`` preset), without
retraining: SB's Figure 8 (target confidence on the test set, inverse CDF) and Figure 9
(accuracy per confidence percentile bin), SB's final model against Traditional's after the same
epochs and after the same wall-clock; the Diet-SB poster's overlaps (EL2N of two architectures;
SB's least used against EL2N's lowest) with two random rankings' overlap; selection frequency;
the stability of the selected set between epochs; the selection rate by class; galleries of
the easiest, hardest, least and most used and lowest combined-rank training images; and, with
labels flipped, the share of flipped labels among the most selected. Writes the PNGs into
``FOLDER/analysis/``, the numbers into ``analysis.md`` and ``analysis.json``, and one
self-contained ``FOLDER/report.html`` with them, the run's own figures and its tables.

    python3 benchmarks/run.py --preset analysis        # trains, then writes all of this
    python3 benchmarks/analysis.py results/analysis-...  # again, from a folder
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:
    # Run as a file: this checkout's benchmarks and sbloader (see run.py).
    import runpy
    import sys
    from pathlib import Path

    sys.path[0] = str(Path(__file__).resolve().parents[1])
    runpy.run_module("benchmarks.analysis", run_name="__main__", alter_sys=True)
    raise SystemExit(0)

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.core.config import Config
from benchmarks.core.figures import all_figures
from benchmarks.core.findings import analyse, el2n_scores_of, load_run_arrays
from benchmarks.core.html import write_report


def _train_images(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """The configuration's training images and clean labels (galleries)."""
    from benchmarks.core.data import load_data

    x, y, _, _ = load_data(cfg)
    return x.numpy(), y.numpy()


def write_analysis(
    folder: Path,
    sb: str | None = None,
    traditional: str = "traditional",
    seed: int | None = None,
    images: tuple[np.ndarray, np.ndarray] | None = None,
) -> Path:
    """The whole analysis of ``folder`` (see the module docstring); returns report.html's path.

    ``images``: the training images and their clean labels (default: loaded as the folder's
    ``config.json`` says)."""
    cfg = Config.from_dict(json.loads((folder / "config.json").read_text()))
    loaded = load_run_arrays(folder)
    if not loaded:
        raise ValueError(
            f"{folder} has no runs with saved arrays (runs/*.npz); run the benchmark with "
            "keep_outputs, e.g. python3 benchmarks/run.py --preset analysis"
        )
    first = seed if seed is not None else min(x.run.seed for x in loaded)
    el2n = el2n_scores_of(folder, cfg.el2n_archs, first)
    an = analyse(loaded, el2n, sb, traditional, first)
    x, y = images if images is not None else _train_images(cfg)
    figures = all_figures(an, folder / "analysis", x, y)
    numbers: dict[str, Any] = dict(an.numbers)
    (folder / "analysis.json").write_text(json.dumps(numbers, indent=1) + "\n")
    lines = ["| measure | value |", "|---|---|"]
    lines += [f"| {k} | {'n/a' if v is None else f'{v:.4f}'} |" for k, v in numbers.items()]
    (folder / "analysis.md").write_text("\n".join(lines) + "\n")
    runs = ", ".join(r.label for r in (an.sb, an.trad, an.noisy) if r is not None)
    intro = (
        f"Preset {cfg.preset}: {cfg.dataset}, {cfg.model}, {cfg.epochs} planned epochs; runs "
        f"analysed: {runs}; EL2N scores of {', '.join(el2n) or 'no model'} ({cfg.el2n_models} "
        f"copies x {cfg.el2n_epochs} epochs). Percentages are shares of the test set or of the "
        "training set."
    )
    return write_report(folder, figures, numbers, f"sbloader: what {an.sb.label} did", intro)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("folder", help="a benchmark folder (run.py --out) with runs/*.npz")
    p.add_argument("--sb", help="the SB run's strategy (default: the first selective one kept)")
    p.add_argument("--traditional", default="traditional", help="the Traditional run's strategy")
    p.add_argument("--seed", type=int, help="the seed to analyse (default: the first)")
    args = p.parse_args(argv)
    path = write_analysis(Path(args.folder), args.sb, args.traditional, args.seed)
    print(json.dumps(json.loads((path.parent / "analysis.json").read_text()), indent=1))
    print(f"Report: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
