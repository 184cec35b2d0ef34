// Kernels that Triton compiled, launched from C++ through the CUDA driver (driver.cpp): what a launch needs of one
// compiled kernel, and the launch itself, for the launched packers of replayed saves (saved.cpp).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace gactx {

// One compiled kernel, loaded: the driver's handle of its function, its block and dynamic shared memory, and how many
// null scratch pointers follow its parameters (newer Tritons append them; native.kinds).
struct Kernel {
  int64_t function = 0;
  int64_t threads = 0, shared = 0, scratch = 0;
};

// The kernel on ``stream`` over ``grid`` programs, its parameters the addresses of ``count`` values (the scratch
// pointers not among them). Throws with the driver's error where the launch fails.
void launch_kernel(const Kernel& kernel, int64_t grid, void* stream, void** params, int count);

// Whether work launched on ``stream`` is being captured into a CUDA graph (then replayed without the host).
bool stream_capturing(void* stream);

// torch's current stream on ``device`` as the driver takes it (null on a CPU: the recording driver's tests).
void* current_stream(const c10::Device& device);

}  // namespace gactx
