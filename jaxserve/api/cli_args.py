"""Old path of `jaxserve.cli.serve_args` (the server's flags): this name is that module."""
from __future__ import annotations

import sys

from jaxserve.cli import serve_args as _module

sys.modules[__name__] = _module
