"""Compiler parameters shared by the Mosaic GPU kernels of this package."""
from __future__ import annotations

from typing import Any

from jax.experimental.pallas import mosaic_gpu as plgpu


def compiler_params(**kw: Any) -> plgpu.CompilerParams:
    """The kernels are written with lane semantics (per-thread register layouts: WGMMA
    layouts, layout_cast, plgpu.load with a layout). jax 0.11 made warpgroup semantics
    the default, under which they do not lower (seen on an H200 with jax 0.11.2), so
    they ask for lane semantics by name."""
    return plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane, **kw)
