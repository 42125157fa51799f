"""``python -m aioloader.plot stats.json stats.png``: draw statistics saved earlier.

Save them with ``loader.stats().to_json()`` (written to a file), draw them later or
elsewhere, as ``loader.stats().plot(path)`` would have (``.png``, or ``.html`` for a
page with the picture and the table; docs/stats.md, "Picture"). Needs matplotlib:
``pip install aioloader[plot]``.
"""

from __future__ import annotations

import argparse
import sys

from ._stats.report import LoaderStats

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """The command line: ``stats.json`` in, the picture (or page) out; 0 when written."""
    p = argparse.ArgumentParser(prog="python -m aioloader.plot",
                                description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("stats", help="a JSON file of loader.stats().to_json()")
    p.add_argument("out", help="the file to write: .png, or .html (picture and table)")
    args = p.parse_args(argv)
    try:
        with open(args.stats, encoding="utf-8") as f:
            stats = LoaderStats.from_json(f.read())
        stats.plot(args.out)
    except (OSError, ValueError, ImportError) as exc:
        p.error(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
