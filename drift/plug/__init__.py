"""The code under test and how it is named: spec grammar, sgl_kernel_npu shim, the built-in
updates (assembled from named parts), the mutant catalogue, the NPU op adapter, and one
loader front door (:func:`load_update`, :func:`load_kernel`)."""
