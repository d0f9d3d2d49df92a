"""Old path of `jaxserve.cli.generate` (`python -m jaxserve.generate`):
this name is that module."""
from __future__ import annotations

import sys

from jaxserve.cli import generate as _module

if __name__ == "__main__":
    _module.main()
else:
    sys.modules[__name__] = _module
