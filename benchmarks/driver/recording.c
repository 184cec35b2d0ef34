/* A recording CUDA driver: libcuda.so.1's entry points that Triton's launcher (driver.c) and gactx's call, each
 * succeeding, for a machine with no GPU. Each module load, function lookup and launch is appended to the file named by
 * $GACTX_RECORDING_DRIVER_LOG, one line each; a launch writes the bytes of each kernel parameter in hexadecimal, their
 * sizes set beforehand with recording_expect(), or for one kernel by its name with recording_expect_function() (the
 * real driver reads them from the cubin). Each kernel name looked up has a handle of its own. recording_capture() makes
 * streams report a capture by CUDA graphs. */
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
#define MAX_FUNCTIONS 1024
static int expected = 0, sizes[MAX_PARAMS];
/* Sizes by kernel name (recording_expect_function), and a handle for each kernel of each distinct image loaded: a
 * launch names its kernel by the image's hash and the kernel's name, so that two loads of the same cubin launch alike. */
static struct {
  char name[256];
  int expected; /* -1: the sizes of recording_expect() */
  int sizes[MAX_PARAMS];
} named[MAX_FUNCTIONS];
static struct {
  unsigned long long image;
  char name[256];
} functions[MAX_FUNCTIONS];
static unsigned long long modules[MAX_FUNCTIONS];
static int named_count = 0, function_count = 0, module_count = 0;

static int named_index(const char *name) {
  for (int i = 0; i < named_count; i++)
    if (strcmp(named[i].name, name) == 0) return i;
  if (named_count == MAX_FUNCTIONS) return MAX_FUNCTIONS - 1;
  snprintf(named[named_count].name, sizeof named[0].name, "%s", name);
  named[named_count].expected = -1;
  return named_count++;
}

/* FNV-1a of a cubin (an ELF64 image: its size is where its section headers end). */
static unsigned long long image_hash(const void *image) {
  const unsigned char *b = (const unsigned char *)image;
  unsigned long long size = 64, hash = 1469598103934665603ULL;
  if (b[0] == 0x7f && b[1] == 'E' && b[2] == 'L' && b[3] == 'F' && b[4] == 2) {
    unsigned long long shoff;
    unsigned short shentsize, shnum;
    memcpy(&shoff, b + 0x28, 8);
    memcpy(&shentsize, b + 0x3A, 2);
    memcpy(&shnum, b + 0x3C, 2);
    size = shoff + (unsigned long long)shentsize * shnum;
  }
  for (unsigned long long i = 0; i < size; i++) hash = (hash ^ b[i]) * 1099511628211ULL;
  return hash;
}

void recording_expect(int n, const int *param_sizes) {
  expected = n < MAX_PARAMS ? n : MAX_PARAMS;
  memcpy(sizes, param_sizes, expected * sizeof(int));
}

void recording_expect_function(const char *name, int n, const int *param_sizes) {
  int i = named_index(name);
  named[i].expected = n < MAX_PARAMS ? n : MAX_PARAMS;
  memcpy(named[i].sizes, param_sizes, named[i].expected * sizeof(int));
}

static void record_params(CUfunction f, void **params) {
  int index = (int)(((char *)f - (char *)functions) / sizeof functions[0]);
  const char *name = index >= 0 && index < function_count ? functions[index].name : "?";
  record(" function %016llx:%s params", index >= 0 && index < function_count ? functions[index].image : 0ULL, name);
  int i_named = named_index(name);
  int own = named[i_named].expected >= 0;
  int n = own ? named[i_named].expected : expected;
  const int *each = own ? named[i_named].sizes : sizes;
  for (int i = 0; params && i < n; i++) {
    record(" ");
    for (int b = 0; b < each[i]; b++) record("%02x", ((const unsigned char *)params[i])[b]);
  }
  record("\n");
}

static int context;
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
  unsigned long long hash = image_hash(image);
  int i = module_count < MAX_FUNCTIONS ? module_count++ : MAX_FUNCTIONS - 1;
  modules[i] = hash;
  *m = (CUmodule)&modules[i];
  record("load %016llx\n", hash);
  return CUDA_SUCCESS;
}
CUresult cuModuleUnload(CUmodule m) { return CUDA_SUCCESS; }
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) {
  unsigned long long image = *(unsigned long long *)m;
  int i = 0;
  while (i < function_count && !(functions[i].image == image && strcmp(functions[i].name, name) == 0)) i++;
  if (i == function_count && function_count < MAX_FUNCTIONS) {
    functions[i].image = image;
    snprintf(functions[i].name, sizeof functions[0].name, "%s", name);
    function_count++;
  }
  *f = (CUfunction)&functions[i < MAX_FUNCTIONS ? i : MAX_FUNCTIONS - 1];
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
/* recording_capture(1): every stream reports a capture under way (a CUDA graph being captured), until (0). */
static int capturing = 0;
void recording_capture(int on) { capturing = on; }
CUresult cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status) {
  *status = capturing ? CU_STREAM_CAPTURE_STATUS_ACTIVE : CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
  record("launch grid %u %u %u block %u %u %u shared %u stream %p", c->gridDimX, c->gridDimY, c->gridDimZ,
         c->blockDimX, c->blockDimY, c->blockDimZ, c->sharedMemBytes, (void *)c->hStream);
  record_params(f, params);
  return CUDA_SUCCESS;
}
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, CUstream stream, void **params, void **extra) {
  record("launch grid %u %u %u block %u %u %u shared %u stream %p", gx, gy, gz, bx, by, bz, shared,
         (void *)stream);
  record_params(f, params);
  return CUDA_SUCCESS;
}
