"""Builds torch_p2p._C with torch.utils.cpp_extension.

libfabric comes from pkg-config, or from LIBFABRIC_HOME (e.g. /opt/amazon/efa on AWS), which
also gets an rpath. CUDA sources are built when torch has CUDA and a toolkit is found, or with
FORCE_CUDA=1 (the torchvision switch); WITH_CUDA=0 forces a host-only build.
"""
import glob
import os
import shlex
import subprocess
import sys

from setuptools import setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))


def libfabric_flags():
    home = os.environ.get("LIBFABRIC_HOME")
    if home:
        include = os.path.join(home, "include")
        libdirs = [d for d in (os.path.join(home, "lib64"), os.path.join(home, "lib")) if os.path.isdir(d)]
        if not os.path.exists(os.path.join(include, "rdma", "fabric.h")) or not libdirs:
            sys.exit(f"LIBFABRIC_HOME={home} has no include/rdma/fabric.h or lib dir; point it at a libfabric install")
        return [include], libdirs, libdirs
    try:
        cflags = subprocess.check_output(["pkg-config", "--cflags", "libfabric"], text=True)
        libs = subprocess.check_output(["pkg-config", "--libs-only-L", "libfabric"], text=True)
    except (OSError, subprocess.CalledProcessError):
        sys.exit(
            "libfabric not found. Install it (Debian/Ubuntu: apt-get install libfabric-dev pkg-config) "
            "or set LIBFABRIC_HOME to a libfabric install (AWS EFA: /opt/amazon/efa)."
        )
    include = [f[2:] for f in shlex.split(cflags) if f.startswith("-I")]
    libdirs = [f[2:] for f in shlex.split(libs) if f.startswith("-L")]
    return include, libdirs, []


def with_cuda():
    forced = os.environ.get("WITH_CUDA")
    if forced is not None:
        return forced == "1"
    if os.environ.get("FORCE_CUDA") == "1":
        return True
    return torch.version.cuda is not None and CUDA_HOME is not None and torch.cuda.is_available()


def extension():
    include, libdirs, rpath = libfabric_flags()
    cuda = with_cuda()
    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    if cuda:
        sources += sorted(glob.glob("csrc/**/*.cu", recursive=True))
    else:
        sources = [s for s in sources if not s.startswith("csrc/cuda/")]
    # -g0: Python's CFLAGS carry -g, and writing the debug info of torch's templates is about a
    # fifth of the compile of a file that includes torch's headers; the sanitizer build keeps -g.
    cxx = ["-O3", "-g0", "-Wall", "-Wno-unused-parameter"]
    defines = []
    if cuda:
        defines.append(("WITH_CUDA", None))
    if os.environ.get("TORCH_P2P_SANITIZE"):
        cxx += ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined"]
    kwargs = dict(
        name="torch_p2p._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")] + include,
        library_dirs=libdirs,
        libraries=["fabric"],
        runtime_library_dirs=rpath,
        define_macros=defines,
        extra_compile_args={"cxx": cxx, "nvcc": ["-O3"]},
        extra_link_args=["-fsanitize=address,undefined"] if os.environ.get("TORCH_P2P_SANITIZE") else [],
    )
    print(f"torch_p2p build: cuda={'yes' if cuda else 'no'}, libfabric include={include or ['system']}, "
          f"libs={libdirs or ['system']}, rpath={rpath or ['none']}", flush=True)
    return (CUDAExtension if cuda else CppExtension)(**kwargs)


class BuildKept(BuildExtension):
    """Object files under build/temp of the tree, for every build: `pip install -e .` would
    otherwise compile in a new temporary directory each time, every source again."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.path.join(ROOT, "build", "temp")


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildKept.with_options(use_ninja=True)},
)
