"""What SGLang's Python needs to import on a machine without its kernels: SGLang's own
``maybe_stub_sgl_kernel()`` (as its CPU CI does) and a stand-in for torchvision, whose PyPI
build does not load against the CPU torch and which SGLang imports only for vision models
(``configs`` -> ``multimodal/internvl_utils``); on a CUDA host without SGLang's kernel package, a
stand-in for ``sgl_kernel`` too. Install before the first ``import sglang``."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from unittest.mock import MagicMock


class _Stub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Every module under `root` as an empty module whose attributes are MagicMocks."""

    def __init__(self, root: str):
        self.root = root

    def find_spec(self, fullname, path, target=None):
        if fullname == self.root or fullname.startswith(self.root + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__getattr__ = lambda name: MagicMock()


def install() -> None:
    try:
        import torchvision  # noqa: F401  (a working build wins)
    except Exception:  # noqa: BLE001 - a build that does not load raises RuntimeError, not ImportError
        sys.modules.pop("torchvision", None)
        sys.meta_path.insert(0, _Stub("torchvision"))
    import torch

    if torch.cuda.is_available():  # SGLang imports sgl_kernel on CUDA before it could stub it
        try:
            import sgl_kernel  # noqa: F401  (a real build wins)
        except ImportError:
            sys.meta_path.insert(0, _Stub("sgl_kernel"))
    from sglang.test.test_utils import maybe_stub_sgl_kernel

    maybe_stub_sgl_kernel()
