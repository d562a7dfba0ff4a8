// Shared helpers for the pagedkv kernels.
//
// Compiled three ways: by NVRTC at run time (CuPy RawModule), by NVRTC for sm_90 in CI
// (compile and ptxas check), and by g++ as plain C++ together with
// tests/kernels/kernel_host/cuda_host_shim.h, which provides the CUDA built-ins on the CPU.
// Keep to what that shim supports: thread/block indices, __syncthreads, __shfl_xor_sync
// with a mask of exactly the warp's lanes (pkv::lanes_mask), static and dynamic shared
// memory (PKV_DYNAMIC_SMEM), atomics.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#ifndef PKV_HOST_SHIM
#define PKV_DYNAMIC_SMEM(type, name) extern __shared__ __align__(16) type name[]
#endif

namespace pkv {

typedef long long i64;

// Conversions to and from fp32 for the three storage types.
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) {
    return __float2half_rn(x);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// A copy unit of N bytes, loaded and stored with one instruction (16 B = one uint4).
template <int N> struct Chunk;
template <> struct Chunk<16> { typedef uint4 type; };
template <> struct Chunk<8> { typedef uint2 type; };
template <> struct Chunk<4> { typedef unsigned int type; };
template <> struct Chunk<2> { typedef unsigned short type; };

// VEC elements of T, moved with as few instructions as possible: units of up to 16 bytes
// (VEC * sizeof(T) is 2, 4, 8, 16 or a multiple of 16; the address must be aligned to
// min(16, VEC * sizeof(T)) bytes, which the host checks before it picks VEC > 1).
template <typename T, int VEC> struct Vec {
    static constexpr int BYTES = (int)sizeof(T) * VEC;
    static constexpr int UB = BYTES >= 16 ? 16 : BYTES;
    static constexpr int NU = BYTES / UB;
    typedef typename Chunk<UB>::type unit;
    union {
        unit u[NU];
        T e[VEC];
    };
    __device__ __forceinline__ Vec() {}
    __device__ __forceinline__ void load(const T* p) {
#pragma unroll
        for (int i = 0; i < NU; ++i) u[i] = reinterpret_cast<const unit*>(p)[i];
    }
    __device__ __forceinline__ void store(T* p) const {
#pragma unroll
        for (int i = 0; i < NU; ++i) reinterpret_cast<unit*>(p)[i] = u[i];
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < VEC; ++i) e[i] = from_float<T>(0.0f);
    }
};

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int imax(int a, int b) { return a > b ? a : b; }

// The shuffle mask of a warp with `lanes` threads (32 or more: all of them).
__device__ __forceinline__ unsigned lanes_mask(int lanes) {
    return lanes >= 32 ? 0xffffffffu : (1u << lanes) - 1u;
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float quiet_nan() { return __int_as_float(0x7fffffff); }

}  // namespace pkv
