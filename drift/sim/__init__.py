"""The simulated deployment: input stream, portable kernels (with float64 naive definitions and
the native CPU kernel), the float64 twin, and the state pool with the backend harness."""
