"""Our server with a `bench.kernel_sweep` variant of the paged decode kernel, for a server
A/B of a kernel before it moves into the engine.

    python -m bench.serve_variant vector serve --load-format dummy --model llama3-8b ...
    python -m bench.run ... --ours-kernel-variant vector

The variant replaces the kernel the engine's `paged_decode` launches in this process
(`kernel_sweep.use_variant`) before the server starts; everything else is `mlx-headroom
serve`. Session 9 found the `vector` variant 5-19 % faster than the engine's kernel alone at
batch 32 (interleaved, three pairs), and the whole decode step could not separate it from
noise, so the server's own throughput is the next measurement.
"""

from __future__ import annotations

import sys

from bench import kernel_sweep


def main(argv: list[str]) -> int:
    known = [name for name, *_ in kernel_sweep.VARIANTS]
    if not argv or argv[0] not in known:
        print(f"usage: python -m bench.serve_variant VARIANT serve ...; VARIANT is one of {known}",
              file=sys.stderr)
        return 2
    kernel_sweep.use_variant(argv[0])
    from server.cli import main as serve

    return serve(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
