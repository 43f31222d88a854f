"""Re-encodes plots (PNG) as 128-colour palette PNGs: about a third of matplotlib's RGBA size, the same plot.

benchmarks/results/ keeps to a size budget (tests/test_results_folder.py); run this on new plots first.

    python scripts/compact_plots.py benchmarks/results            # every PNG under the folder
    python scripts/compact_plots.py benchmarks/results/foo.png    # one file
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

from PIL import Image

COLORS = 128


def compact(path: str) -> tuple[int, int]:
    """Rewrites ``path`` as a palette PNG (opaque plots only; a translucent one is left as it is)."""
    before = os.path.getsize(path)
    image = Image.open(path)
    if image.mode == "P":
        return before, before
    if image.mode in ("RGBA", "LA") and image.getchannel("A").getextrema()[0] < 255:
        print(f"{path}: has transparent pixels, left as it is", file=sys.stderr)
        return before, before
    palette = image.convert("RGB").quantize(colors=COLORS, method=Image.Quantize.MEDIANCUT,
                                            dither=Image.Dither.NONE)
    palette.save(path, format="PNG", optimize=True)
    return before, os.path.getsize(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="PNG files or folders to search for them")
    args = parser.parse_args()
    files = []
    for path in args.paths:
        if os.path.isdir(path):
            files += sorted(glob.glob(os.path.join(path, "**", "*.png"), recursive=True))
        elif path.endswith(".png") and os.path.isfile(path):
            files.append(path)
        else:
            parser.error(f"paths: expected PNG files or folders, got {path!r}")
    total_before = total_after = 0
    for path in files:
        before, after = compact(path)
        total_before, total_after = total_before + before, total_after + after
    print(f"{len(files)} plots: {total_before:,} -> {total_after:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
