// cuflash/kernels_cu/common.cuh
// The core device toolkit in one include: types, sm80 PTX wrappers, conversions, the swizzle and
// the fragment maps (core/). Every entry header (flash_*.cuh) includes it first. It is also the
// file cuflash/_compile.py looks for to find kernels_cu/ (kernel_dir), so it stays at the root.
#pragma once
#include "core/types.cuh"
#include "core/ptx_sm80.cuh"
#include "core/convert.cuh"
#include "core/swizzle.cuh"
#include "core/frag.cuh"
