/* The tensor-map encoders Triton's launcher links: gactx's kernels take no tensor descriptors. */
int cuTensorMapEncodeTiled(void) { return 801; /* CUDA_ERROR_NOT_SUPPORTED */ }
int cuTensorMapEncodeIm2col(void) { return 801; }
