"""Tensor-parallel serving on MLX's distributed engine (`mx.distributed`, `mlx.launch`).

- `config`: what the group needs to know, as values the server fills from its settings;
- `launcher`: `serve --tensor-parallel N` starts the ranks through `mlx.launch`;
- `rank`: rank 0 under the HTTP server, the others following it;
- `lockstep`: the step plan, shared admission decisions and agreed tokens;
- `channel`: JSON messages over MLX's collectives; `watchdog`: a deadline on them;
- `probe`: every rank's memory, and the tightest one admission decides on;
- `loading`: each rank's shard, loaded lazily and split with mlx-lm's `shard()`.

docs/tensor-parallel.md says how it fits together and what was measured.
"""
