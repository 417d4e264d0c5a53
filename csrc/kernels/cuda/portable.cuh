// The thin portability layer between CUDA and MUSA (Moore Threads). Every GPU source of mtdeepep names the runtime
// and the types through these aliases, so the same files build with nvcc (CUDA) and with mcc (MUSA, compiled with
// `-DMTDEEPEP_MUSA`, which torch_musa's extension builder adds through setup.py).
//
// MUSA mirrors the CUDA runtime API one to one with a `musa` prefix (musaMalloc, musaIpcGetMemHandle, musaStream_t,
// ...), and its device compiler accepts CUDA's built-ins (threadIdx, __shfl_xor_sync, atomics, fences, clock64).
// The only differences the kernels meet are the header names and the runtime prefix. The kernels convert bfloat16,
// float16 and float8_e4m3fn on the bits (the same rounding as torch and the CPU kernels, bit for bit) rather than
// through the toolkits' FP8/BF16 types, whose names and conversion intrinsics differ between CUDA and MUSA: the
// payloads are plain uint8_t/uint16_t storage everywhere.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(MTDEEPEP_MUSA)
#include <musa_runtime.h>

#define MTDEEPEP_GPU_PREFIX(name) musa##name
using gpuStream_t = musaStream_t;
using gpuEvent_t = musaEvent_t;
using gpuError_t = musaError_t;
using gpuIpcMemHandle_t = musaIpcMemHandle_t;
using gpuFuncAttributes = musaFuncAttributes;
#define gpuSuccess musaSuccess
#define gpuIpcMemLazyEnablePeerAccess musaIpcMemLazyEnablePeerAccess
#define gpuHostAllocMapped musaHostAllocMapped
#define gpuHostAllocPortable musaHostAllocPortable
#define gpuEventDisableTiming musaEventDisableTiming
#define gpuMemcpyDeviceToDevice musaMemcpyDeviceToDevice
#define gpuMemcpyHostToDevice musaMemcpyHostToDevice
#define gpuMemcpyDeviceToHost musaMemcpyDeviceToHost
#define gpuDevAttrMultiProcessorCount musaDevAttrMultiProcessorCount
#else
#include <cuda_runtime.h>

#define MTDEEPEP_GPU_PREFIX(name) cuda##name
using gpuStream_t = cudaStream_t;
using gpuEvent_t = cudaEvent_t;
using gpuError_t = cudaError_t;
using gpuIpcMemHandle_t = cudaIpcMemHandle_t;
using gpuFuncAttributes = cudaFuncAttributes;
#define gpuSuccess cudaSuccess
#define gpuIpcMemLazyEnablePeerAccess cudaIpcMemLazyEnablePeerAccess
#define gpuHostAllocMapped cudaHostAllocMapped
#define gpuHostAllocPortable cudaHostAllocPortable
#define gpuEventDisableTiming cudaEventDisableTiming
#define gpuMemcpyDeviceToDevice cudaMemcpyDeviceToDevice
#define gpuMemcpyHostToDevice cudaMemcpyHostToDevice
#define gpuMemcpyDeviceToHost cudaMemcpyDeviceToHost
#define gpuDevAttrMultiProcessorCount cudaDevAttrMultiProcessorCount
#endif

// The runtime calls the host code uses, under one spelling.
#define gpuMalloc MTDEEPEP_GPU_PREFIX(Malloc)
#define gpuFree MTDEEPEP_GPU_PREFIX(Free)
#define gpuMemset MTDEEPEP_GPU_PREFIX(Memset)
#define gpuMallocHost MTDEEPEP_GPU_PREFIX(MallocHost)
#define gpuPointerGetAttributes MTDEEPEP_GPU_PREFIX(PointerGetAttributes)
#define gpuLaunchKernel MTDEEPEP_GPU_PREFIX(LaunchKernel)
#define gpuMemsetAsync MTDEEPEP_GPU_PREFIX(MemsetAsync)
#define gpuMemcpy MTDEEPEP_GPU_PREFIX(Memcpy)
#define gpuMemcpyAsync MTDEEPEP_GPU_PREFIX(MemcpyAsync)
#define gpuHostAlloc MTDEEPEP_GPU_PREFIX(HostAlloc)
#define gpuHostGetDevicePointer MTDEEPEP_GPU_PREFIX(HostGetDevicePointer)
#define gpuFreeHost MTDEEPEP_GPU_PREFIX(FreeHost)
#define gpuIpcGetMemHandle MTDEEPEP_GPU_PREFIX(IpcGetMemHandle)
#define gpuIpcOpenMemHandle MTDEEPEP_GPU_PREFIX(IpcOpenMemHandle)
#define gpuIpcCloseMemHandle MTDEEPEP_GPU_PREFIX(IpcCloseMemHandle)
#define gpuGetDevice MTDEEPEP_GPU_PREFIX(GetDevice)
#define gpuSetDevice MTDEEPEP_GPU_PREFIX(SetDevice)
#define gpuDeviceGetAttribute MTDEEPEP_GPU_PREFIX(DeviceGetAttribute)
#define gpuDeviceSynchronize MTDEEPEP_GPU_PREFIX(DeviceSynchronize)
#define gpuStreamSynchronize MTDEEPEP_GPU_PREFIX(StreamSynchronize)
#define gpuStreamWaitEvent MTDEEPEP_GPU_PREFIX(StreamWaitEvent)
#define gpuEventCreateWithFlags MTDEEPEP_GPU_PREFIX(EventCreateWithFlags)
#define gpuEventRecord MTDEEPEP_GPU_PREFIX(EventRecord)
#define gpuEventDestroy MTDEEPEP_GPU_PREFIX(EventDestroy)
#define gpuGetLastError MTDEEPEP_GPU_PREFIX(GetLastError)
#define gpuGetErrorString MTDEEPEP_GPU_PREFIX(GetErrorString)
#define gpuFuncGetAttributes MTDEEPEP_GPU_PREFIX(FuncGetAttributes)
