"""``make bench`` entry for the load/soak run (:mod:`benchmarks.soak`)."""

from __future__ import annotations

from benchmarks import soak


def main(argv: list[str] | None = None) -> int:
    return soak.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
