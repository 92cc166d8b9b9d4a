"""bench.ncu_summary groups an Nsight Compute CSV's kernels by name and per step."""

from __future__ import annotations

import gzip

from bench.ncu_summary import group, main, read_kernels

HEADER = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"\n'
ROWS = [
    ("1", "void gemv_single<bf16, 4>(const T*)", "gpu__time_duration.sum", "ns", "3,000"),
    ("1", "void gemv_single<bf16, 4>(const T*)", "dram__bytes.sum", "byte", "9,000"),
    ("2", "mlx::rope<float>", "gpu__time_duration.sum", "ns", "1,000"),
    ("2", "mlx::rope<float>", "dram__bytes.sum", "byte", "10"),
    ("3", "void gemv_single<bf16, 8>(const T*)", "gpu__time_duration.sum", "ns", "5,000"),
    ("3", "void gemv_single<bf16, 8>(const T*)", "dram__bytes.sum", "byte", "15,000"),
]


def _write(path, opener=open) -> None:
    with opener(path, "wt") as f:
        f.write("==PROF== Connected to process 1\n" + HEADER)
        f.writelines(",".join(f'"{c}"' for c in r) + "\n" for r in ROWS)


def test_kernels_are_grouped_by_name_without_template_arguments(tmp_path) -> None:
    path = tmp_path / "ncu.csv.gz"
    _write(path, gzip.open)
    groups = group(read_kernels(path))
    assert [(g.name, g.launches, g.ns, g.dram_bytes) for g in groups] == [
        ("gemv_single", 2, 8000.0, 24000.0), ("rope", 1, 1000.0, 10.0)]


def test_the_report_is_per_step(tmp_path, capsys) -> None:
    path = tmp_path / "ncu.csv"
    _write(path)
    main([str(path), "--steps", "2"])
    out = capsys.readouterr().out
    assert "kernels per step 2, device time per step 0.004 ms" in out
    assert "gemv_single" in out.splitlines()[2] and "88.9%" in out.splitlines()[2]
