"""Build hook (the metadata is in pyproject.toml): ship the top-level dashboard/ inside
the wheel as the package data `server/dashboard/`, so an installed server serves it.

The project keeps dashboard/ at the top (static files, no Python); setuptools can only
package files that sit inside a package, hence the copy at build time. From a source
tree (or an editable install) the server finds the top-level directory instead.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DASHBOARD = Path(__file__).resolve().parent / "dashboard"


class BuildPyWithDashboard(build_py):
    def run(self) -> None:
        super().run()
        target = Path(self.build_lib) / "server" / "dashboard"
        self.mkpath(str(target))
        for path in sorted(DASHBOARD.iterdir()):
            if path.is_file():
                self.copy_file(str(path), str(target / path.name))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        target = Path(self.build_lib) / "server" / "dashboard"
        extra = [str(target / p.name) for p in sorted(DASHBOARD.iterdir()) if p.is_file()]
        return [*super().get_outputs(include_bytecode), *extra]


setup(cmdclass={"build_py": BuildPyWithDashboard})
