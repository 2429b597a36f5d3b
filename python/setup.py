# `pip install --no-build-isolation ./python` after `make python`, which builds the engine's
# module with the project's CMake and copies it into the package: pip only packages it.
import glob
import os

from setuptools import setup

here = os.path.dirname(os.path.abspath(__file__))
if not glob.glob(os.path.join(here, "recur", "_recur*.so")):
    raise SystemExit("python/recur/_recur*.so is missing: run `make python` first")

setup(name="recur", version="0.1.0", description="recur's inference engine with mlx-lm's API",
      packages=["recur"], package_data={"recur": ["_recur*.so"]}, python_requires=">=3.9")
