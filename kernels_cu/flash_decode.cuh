// cuflash/kernels_cu/flash_decode.cuh
// Entry header of the decode kernel for the generated shells (cuflash/_compile.py, the "decode"
// family): attention of a few query rows per sequence to a KV cache, the query heads of a GQA
// group packed into one tile (sm80/decode.cuh). See README.md for the map of kernels_cu/.
#pragma once
#include "common.cuh"
#include "attn/params.cuh"
#include "sm80/decode.cuh"
