"""Package layout (everything else is in pyproject.toml).

``engine``, ``app`` and their subpackages are discovered automatically. The
top-level folders ``shaders/`` (WGSL templates) and ``resources/`` (GUI assets)
are installed as package data under ``engine/shaders`` and ``app/resources``;
code finds them through ``engine.paths.shader_dir()`` / ``resource_dir()``,
which work from a checkout, an editable install and a wheel alike.
"""

import os

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))

packages = find_packages(where=HERE, include=["engine", "engine.*", "app", "app.*"])
package_dir = {}
package_data = {}
for package, folder, patterns in (
    ("engine.shaders", "shaders", ["*.wgsl"]),
    ("app.resources", "resources", ["*"]),
):
    # git keeps no empty folders: only map the ones that exist. Subfolders are
    # data packages of their own (setuptools warns about them otherwise).
    for root, dirs, _files in os.walk(os.path.join(HERE, folder)):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        rel = os.path.relpath(root, HERE)  # "resources" or "resources/icons"
        name = ".".join([package, *rel.split(os.sep)[1:]])
        packages.append(name)
        package_dir[name] = rel
        package_data[name] = patterns

setup(packages=packages, package_dir=package_dir, package_data=package_data)
