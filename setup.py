"""Build the one native extension, aps._core, from native/_core.pyx."""

from Cython.Build import cythonize
from setuptools import Extension, setup

extension = Extension(
    "aps._core",
    sources=["native/_core.pyx"],
    include_dirs=["native"],
    depends=["native/_optim.pxi", "native/_window.pxi", "native/_rows.pxi", "native/_rows.h", "native/_rows.inc", "native/_kernels.h", "native/_sgd.inc", "native/_wide.inc", "native/_half.h"],
    extra_compile_args=["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off"],
)

setup(
    # Compiler directives live at the top of native/_core.pyx.
    ext_modules=cythonize([extension]),
)
