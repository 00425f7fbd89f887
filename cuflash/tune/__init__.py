"""cuflash's autotuner: `python -m cuflash.tune` (see docs/tuning.md).

Modules, by concern:
  device   DeviceProps: the GPU's limits and identity, from CuPy or from recorded JSON
  space    per-kernel search spaces derived from DeviceProps; static and post-compile pruning
  search   the Optuna study (and the exhaustive sweep) over a space, driven by check/evaluate callables
  runner   GPU side: inputs, correctness against the default config, CUDA-event timing, worker process
  tuner    shapes -> compile check -> search -> confirm -> cache
  cache    the tuned-config store (user cache, shipped tables, --export): keys, atomic writes, loading
  report   summary table, --show, --plot

Importing this package is cheap: Optuna, CuPy and matplotlib are imported only where used. The
call-time lookup lives in cuflash._tuned.
"""
