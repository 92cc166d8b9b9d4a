"""`serve` runs on jemalloc where a Linux machine has it (server.malloc): it re-executes
itself once, in the same process, with the library preloaded; `--malloc system` keeps the C
library's. Real servers on the tiny model; the process's own memory map says which it runs."""

from __future__ import annotations

from pathlib import Path

import httpx

from server.malloc import CHOSEN, early_choice, find_jemalloc, reexec_env, with_openblas

LIB = "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"


def _mapped(pid: int) -> bool:
    return "libjemalloc" in Path(f"/proc/{pid}/maps").read_text()


def test_auto_preloads_jemalloc_once_before_what_was_preloaded() -> None:
    env = reexec_env("auto", {"LD_PRELOAD": "libopenblas.so.0", "PATH": "/bin"}, "linux", LIB)
    assert env == {"LD_PRELOAD": f"{LIB} libopenblas.so.0", "PATH": "/bin", CHOSEN: "1"}
    assert reexec_env("auto", env, "linux", LIB) is None  # the re-executed process goes on
    assert reexec_env("auto", {}, "linux", LIB) == {"LD_PRELOAD": LIB, CHOSEN: "1"}


def test_system_macos_an_existing_preload_or_no_library_leave_the_process_alone() -> None:
    assert reexec_env("system", {}, "linux", LIB) is None
    assert reexec_env("auto", {}, "darwin", LIB) is None
    assert reexec_env("auto", {"LD_PRELOAD": "/opt/libjemalloc.so.2"}, "linux", LIB) is None
    assert find_jemalloc(("/nonexistent",)) is None


def test_openblas_is_preloaded_once_on_linux_unless_turned_off() -> None:
    blas = "/usr/lib/x86_64-linux-gnu/libopenblas.so.0"
    env = with_openblas({"LD_PRELOAD": LIB}, "linux", blas)
    assert env == {"LD_PRELOAD": f"{LIB} {blas}"}
    assert with_openblas(env, "linux", blas) is None  # the re-executed process goes on
    assert with_openblas({}, "darwin", blas) is None
    assert with_openblas({"MLX_HEADROOM_OPENBLAS": "0"}, "linux", blas) is None


def test_the_server_runs_with_openblas_preloaded_where_installed(start_server) -> None:
    proc = start_server(env={"LD_PRELOAD": ""})
    assert proc.proc is not None
    assert "libopenblas" in Path(f"/proc/{proc.proc.pid}/maps").read_text()


def test_the_choice_is_read_from_the_command_line_before_the_environment() -> None:
    assert early_choice(["serve", "--malloc", "system"], {}) == "system"
    assert early_choice(["serve", "--malloc=system"], {"MLX_HEADROOM_MALLOC": "auto"}) == "system"
    assert early_choice(["serve"], {"MLX_HEADROOM_MALLOC": "SYSTEM"}) == "system"
    assert early_choice(["serve", "--port", "1"], {}) == "auto"


def test_the_server_runs_on_jemalloc_in_its_own_process(server) -> None:
    assert find_jemalloc() is not None, "libjemalloc2 is not installed (.ci/run installs it)"
    srv = server  # the shared server runs on the defaults
    assert httpx.get(srv.url + "/v1/version").json()["malloc"] == "jemalloc"
    assert _mapped(srv.proc.pid)  # the process the test started is the one serving
    assert "memory allocator: jemalloc" in srv.log()
    r = httpx.post(srv.url + "/v1/completions", timeout=60, json={
        "model": "mlx-headroom/tiny-chat", "prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_malloc_system_keeps_the_c_librarys(start_server) -> None:
    srv = start_server(args=["--malloc", "system"])
    assert httpx.get(srv.url + "/v1/version").json()["malloc"] == "system"
    assert not _mapped(srv.proc.pid)
    assert "memory allocator: system" in srv.log()


def test_an_env_files_malloc_system_is_honoured(start_server, tmp_path) -> None:
    """The early choice cannot see an env file; the parsed settings undo its preload."""
    env_file = tmp_path / "env"
    env_file.write_text("MLX_HEADROOM_MALLOC=system\n")
    srv = start_server(args=["--env-file", str(env_file)])
    assert httpx.get(srv.url + "/v1/version").json()["malloc"] == "system"
    assert not _mapped(srv.proc.pid)
