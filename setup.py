"""The build step of `pip install .` (pyproject.toml): configures the project with CMake for this
interpreter, builds the extension target only, and puts the built _moefq module and the shipped
recipe units into the package. Extra CMake arguments: the CMAKE_ARGS environment variable (e.g.
-DMOEFQ_ENABLE_CUDA=OFF); parallel jobs: MOEFQ_JOBS (default: all cores)."""

import glob
import os
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

ROOT = os.path.dirname(os.path.abspath(__file__))


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = os.path.abspath(os.path.join(self.build_temp, "cmake"))
        configure = ["cmake", "-S", ROOT, "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release", "-DMOEFQ_BUILD_TESTS=OFF",
                     "-DMOEFQ_FUZZ=OFF", "-DMOEFQ_PYTHON=ON", f"-DPython3_EXECUTABLE={sys.executable}"]
        configure += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        subprocess.run(configure, check=True)
        jobs = os.environ.get("MOEFQ_JOBS", str(os.cpu_count() or 1))
        subprocess.run(["cmake", "--build", build_dir, "--target", "moefq_python", "-j", jobs], check=True)
        built = glob.glob(os.path.join(build_dir, "python", "moefq", "_moefq*.so"))
        if not built:
            sys.exit("moefq: the CMake build made no extension module (is pybind11 installed? Debian: pybind11-dev)")
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built[0], target)


class BuildPyWithRecipes(build_py):
    """The recipe units travel inside the package (moefq/recipes), where moefq finds them by name."""

    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "moefq", "recipes")
        os.makedirs(dest, exist_ok=True)
        for f in glob.glob(os.path.join(ROOT, "recipes", "*.yaml")):
            shutil.copy(f, dest)


# build-pip/: setuptools' own folder, apart from the CMake build folders (build/, build-cpu/).
setup(ext_modules=[Extension("moefq._moefq", sources=[])],
      cmdclass={"build_ext": CMakeBuild, "build_py": BuildPyWithRecipes},
      options={"build": {"build_base": "build-pip"}})
