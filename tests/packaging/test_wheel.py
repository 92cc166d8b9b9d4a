"""A real wheel, installed into a fresh venv, serves everything: the dashboard (package
data, not the source tree) and a chat completion.

Lean on purpose: `pip wheel --no-deps --no-build-isolation` (no download), and the new
venv sees this environment's dependencies through a .pth line instead of installing them
again; the project itself comes only from the wheel (checked: `server` imports from the
new venv, run from outside the source tree).
"""

from __future__ import annotations

import shutil
import signal
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import httpx

from tests.conftest import ROOT, free_port, wait_until

MODEL = "mlx-headroom/tiny-chat"
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "server", "engine", "memory",
           "dashboard")


def _run(cmd: list[str], **kwargs: object) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)  # type: ignore[call-overload]
    assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
    return str(r.stdout)


def test_the_wheel_serves_the_dashboard_and_a_chat_completion(tiny_model_path, tmp_path):
    src = tmp_path / "src"  # a copy: the build leaves build/ and egg-info behind
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy2(path, src / name)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(dist), str(src)])
    (wheel,) = dist.glob("mlx_headroom-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / "bin" / "python"
    query = "import sysconfig; print(sysconfig.get_path('purelib'))"
    purelib = Path(_run([str(python), "-c", query]).strip())
    # Dependencies from this environment, after the venv's own site-packages.
    deps = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib"), *site.getsitepackages()}
    (purelib / "_test_dependencies.pth").write_text("".join(f"{d}\n" for d in sorted(deps)))
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
          str(wheel)])

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    where = _run([str(python), "-c", "import server.app as a; print(a.__file__); print(a.DASHBOARD_DIR)"],
                 cwd=outside).split()
    assert where[0].startswith(str(purelib)) and where[1] == str(purelib / "server" / "dashboard")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    proc = subprocess.Popen([str(venv / "bin" / "mlx-headroom"), "serve", "--model", str(tiny_model_path),
                             "--port", str(port), "--served-model-name", MODEL],
                            cwd=outside, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(healthy)
        page = httpx.get(f"{url}/dashboard/")
        assert page.status_code == 200 and "<title>mlx-headroom dashboard</title>" in page.text
        assert httpx.get(f"{url}/dashboard/app.js").text == (ROOT / "dashboard/app.js").read_text()
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
