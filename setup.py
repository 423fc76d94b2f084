"""Package list for setuptools; everything else is in pyproject.toml.

The folder ``kernels/`` installs as ``mooncake_kernels``: a top-level package named ``kernels`` is
Hugging Face's (a dependency of transformers since 5.25), and two distributions writing the same
``site-packages/kernels/`` break whichever was installed first.
"""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["mooncake_lite", "mooncake_lite.*"]) + ["mooncake_kernels"],
    package_dir={"mooncake_kernels": "kernels"},
)
