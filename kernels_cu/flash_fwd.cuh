// cuflash/kernels_cu/flash_fwd.cuh
// Entry header of the v2 forward for the generated shells (cuflash/_compile.py, _KERNELS["fwd"]):
// the parameter list and the sm80 mainloop. See README.md for the map of kernels_cu/.
#pragma once
#include "common.cuh"
#include "attn/params.cuh"
#include "sm80/fwd.cuh"
