"""The benchmark: mlx-headroom beside mlx_lm.server and the bare mlx-lm model, by scenario.

`python -m bench --help` lists the scenarios and tools (docs/benchmarks.md). Modules:
`run` (the harness), `scenarios` (what each scenario does, and their table), `loadgen` (the
HTTP load generator), `servers` (the processes under test and what watches them), `bound`
(the bare model's bound), `machine` (what machine ran it), `summary` (summary.json), `table`
and `plot` (a run as markdown and as a PNG), `soak` and `device_agreement` (longer checks of
one server), `estimate_vs_measured` (the memory estimate against MLX's measured peak).
"""
