/* A recording CUDA driver: libcuda.so.1's entry points that Triton's launcher (driver.c) and gactx's call, each
 * succeeding, for a machine with no GPU. Each module load, function lookup and launch is appended to the file named by
 * $GACTX_RECORDING_DRIVER_LOG, one line each; a launch writes the bytes of each kernel parameter in hexadecimal, their
 * sizes set beforehand with recording_expect() (the real driver reads them from the cubin). */
#include <cuda.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void record(const char *format, ...) {
  const char *path = getenv("GACTX_RECORDING_DRIVER_LOG");
  if (!path) return;
  FILE *f = fopen(path, "a");
  if (!f) return;
  va_list args;
  va_start(args, format);
  vfprintf(f, format, args);
  va_end(args);
  fclose(f);
}

#define MAX_PARAMS 64
static int expected = 0, sizes[MAX_PARAMS];

void recording_expect(int n, const int *param_sizes) {
  expected = n < MAX_PARAMS ? n : MAX_PARAMS;
  memcpy(sizes, param_sizes, expected * sizeof(int));
}

static void record_params(void **params) {
  for (int i = 0; params && i < expected; i++) {
    record(" ");
    for (int b = 0; b < sizes[i]; b++) record("%02x", ((const unsigned char *)params[i])[b]);
  }
  record("\n");
}

static int context, module, function;
CUresult cuInit(unsigned flags) { return CUDA_SUCCESS; }
CUresult cuDriverGetVersion(int *version) { *version = 12080; return CUDA_SUCCESS; }
CUresult cuDeviceGetCount(int *n) { *n = 1; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *device, int ordinal) { *device = 0; return CUDA_SUCCESS; }
CUresult cuDeviceGetAttribute(int *value, CUdevice_attribute attribute, CUdevice device) {
  *value = attribute == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR ? 9
           : attribute == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR ? 0 : 1 << 16;
  return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext *c) { *c = (CUcontext)&context; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c) { return CUDA_SUCCESS; }
CUresult cuCtxGetDevice(CUdevice *device) { *device = 0; return CUDA_SUCCESS; }
CUresult cuCtxGetLimit(size_t *value, CUlimit limit) { *value = 0; return CUDA_SUCCESS; }
CUresult cuCtxSetLimit(CUlimit limit, size_t value) { return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice device) { *c = (CUcontext)&context; return CUDA_SUCCESS; }
CUresult cuModuleLoadData(CUmodule *m, const void *image) {
  *m = (CUmodule)&module;
  record("load\n");
  return CUDA_SUCCESS;
}
CUresult cuModuleUnload(CUmodule m) { return CUDA_SUCCESS; }
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
  *f = (CUfunction)&function;
  record("function %s\n", name);
  return CUDA_SUCCESS;
}
CUresult cuFuncGetAttribute(int *value, CUfunction_attribute attribute, CUfunction f) {
  *value = attribute == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 1024 : 0;
  return CUDA_SUCCESS;
}
CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute attribute, int value) { return CUDA_SUCCESS; }
CUresult cuFuncSetCacheConfig(CUfunction f, CUfunc_cache config) { return CUDA_SUCCESS; }
CUresult cuGetErrorString(CUresult error, const char **text) { *text = "recording driver"; return CUDA_SUCCESS; }
CUresult cuOccupancyMaxActiveClusters(int *n, CUfunction f, const CUlaunchConfig *config) { *n = 1; return CUDA_SUCCESS; }
static void device_pointer(void *data, CUpointer_attribute attribute, CUdeviceptr p) {
  memset(data, 0, attribute == CU_POINTER_ATTRIBUTE_DEVICE_POINTER ? sizeof(CUdeviceptr) : sizeof(unsigned));
  if (attribute == CU_POINTER_ATTRIBUTE_DEVICE_POINTER) *(CUdeviceptr *)data = p;
  if (attribute == CU_POINTER_ATTRIBUTE_MEMORY_TYPE) *(unsigned *)data = CU_MEMORYTYPE_DEVICE;
}
CUresult cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr p) {
  device_pointer(data, attribute, p);
  return CUDA_SUCCESS;
}
CUresult cuPointerGetAttributes(unsigned n, CUpointer_attribute *attributes, void **data, CUdeviceptr p) {
  for (unsigned i = 0; i < n; i++) device_pointer(data[i], attributes[i], p);
  return CUDA_SUCCESS;
}
CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status) {
  *status = CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
  record("launch grid %u %u %u block %u %u %u shared %u stream %p params", c->gridDimX, c->gridDimY, c->gridDimZ,
         c->blockDimX, c->blockDimY, c->blockDimZ, c->sharedMemBytes, (void *)c->hStream);
  record_params(params);
  return CUDA_SUCCESS;
}
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, CUstream stream, void **params, void **extra) {
  record("launch grid %u %u %u block %u %u %u shared %u stream %p params", gx, gy, gz, bx, by, bz, shared,
         (void *)stream);
  record_params(params);
  return CUDA_SUCCESS;
}
