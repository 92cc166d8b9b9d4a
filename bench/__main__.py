"""`python -m bench SCENARIO... [options]`, or one of its tools: `table`, `plot`, `summary`,
`convert`, `merge` (`python -m bench --help` lists them all)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    verb = argv[0] if argv else ""
    if verb == "table":
        from bench.table import main as table

        return table(argv[1:])
    if verb == "plot":
        from bench.plot import main as plot

        return plot(argv[1:])
    if verb in ("summary", "convert", "merge"):
        from bench.summary import main as summary

        return summary(argv)
    from bench.run import main as run

    return run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
