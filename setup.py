"""Build hook for the native copy kernel; all metadata lives in pyproject.toml."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "kvtier.kernels._copy",
            sources=["kernels/_copy.c"],
            extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-pthread"],
            extra_link_args=["-pthread"],
        )
    ]
)
