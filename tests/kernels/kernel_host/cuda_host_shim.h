// cuda_host_shim.h: run the pagedkv CUDA kernels as plain C++ on the CPU, for tests.
//
// Include this header, then the kernel .cu files, compile with g++ -std=c++20 -pthread and
// the include folders of the PyPI wheels nvidia-cuda-runtime / nvidia-cuda-crt /
// nvidia-cuda-cccl (`include/` and `include/cccl`): cuda_fp16.h and cuda_bf16.h compile and
// compute on the host, so fp16/bf16 arithmetic is NVIDIA's own.
//
// Execution model of one launch: one OS thread per CUDA thread of a block; the threads walk
// the grid's blocks together, one block at a time, with a barrier between blocks, so that
// static and dynamic shared memory (poisoned with 0xff bytes before each block) are those
// of the current block. __syncthreads() is a barrier across the block's threads;
// __shfl_xor_sync / __shfl_sync exchange through a per-warp buffer between two warp
// barriers (every lane of the warp must call them, as the kernels guarantee). A shuffle's
// mask is checked as a GPU would need it: it must name exactly the lanes that exist in the
// warp (a block whose size is not a multiple of 32 ends in a partial warp, where a full
// 0xffffffff mask is undefined behaviour), every lane must pass the same mask, and the
// source lane must be in it; a violation fails the launch (pkv_host_launch returns -3,
// pkv_host_error() says why). Atomics are std::atomic_ref. A kernel that calls
// __syncthreads must not let any thread return early before it (on a GPU that is
// undefined behaviour as well).
#pragma once
#define PKV_HOST_SHIM 1

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_types.h>

#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#undef __global__
#define __global__
#undef __shared__
#define __shared__ static
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __forceinline__
#define __forceinline__ inline

namespace pkv_host {

typedef std::barrier<> Barrier;

struct Warp {
    std::unique_ptr<Barrier> bar;
    int size = 32;
    alignas(16) unsigned char slot[32][16];
    unsigned mask[32];
};

struct ThreadState {
    uint3 tid, bid;
    int lane = 0;
    Warp* warp = nullptr;
    Barrier* block_bar = nullptr;
};

inline thread_local ThreadState tls;
inline dim3 g_grid, g_block;
inline unsigned char* g_dyn_smem = nullptr;

inline void syncthreads() { tls.block_bar->arrive_and_wait(); }

// The first misuse seen during a launch; the launch reports it instead of its result.
inline std::mutex g_error_mu;
inline std::string g_error;

inline void fail(const std::string& why) {
    std::lock_guard<std::mutex> lock(g_error_mu);
    if (g_error.empty()) g_error = why;
}

inline unsigned lanes_of(int size) { return size >= 32 ? 0xffffffffu : (1u << size) - 1u; }

template <typename T> inline T shfl_from(unsigned mask, T v, int src) {
    static_assert(sizeof(T) <= 16, "shuffle of a type wider than 16 bytes");
    Warp& w = *tls.warp;
    const unsigned present = lanes_of(w.size);
    std::memcpy(w.slot[tls.lane], &v, sizeof(T));
    w.mask[tls.lane] = mask;
    w.bar->arrive_and_wait();
    char why[160] = "";
    if (mask & ~present)
        std::snprintf(why, sizeof why,
                      "shuffle mask 0x%08x names lanes absent from a warp of %d lanes", mask,
                      w.size);
    else if (mask != present)
        std::snprintf(why, sizeof why,
                      "shuffle mask 0x%08x leaves out lanes of a warp of %d that call it", mask,
                      w.size);
    else if (w.mask[0] != mask)
        std::snprintf(why, sizeof why, "lanes of one warp pass different shuffle masks");
    else if (src < 0 || src >= w.size)
        std::snprintf(why, sizeof why, "shuffle reads lane %d, outside a warp of %d", src,
                      w.size);
    if (why[0]) fail(why);
    T r = v;
    if (src >= 0 && src < w.size) std::memcpy(&r, w.slot[src], sizeof(T));
    w.bar->arrive_and_wait();
    return r;
}

// Run body() as a CUDA launch of grid x block threads with smem bytes of dynamic shared memory.
inline void launch(dim3 grid, dim3 block, size_t smem, const std::function<void()>& body) {
    const int nthreads = (int)(block.x * block.y * block.z);
    g_grid = grid;
    g_block = block;
    std::vector<unsigned char> dyn(smem + 16);
    g_dyn_smem = dyn.data() + ((16 - (reinterpret_cast<uintptr_t>(dyn.data()) & 15)) & 15);
    Barrier block_bar(nthreads);
    const int nwarps = (nthreads + 31) / 32;
    std::vector<Warp> warps(nwarps);
    for (int w = 0; w < nwarps; ++w) {
        warps[w].size = std::min(32, nthreads - 32 * w);
        warps[w].bar = std::make_unique<Barrier>(warps[w].size);
    }
    auto run = [&](int t) {
        tls.tid = make_uint3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
        tls.lane = t % 32;
        tls.warp = &warps[t / 32];
        tls.block_bar = &block_bar;
        for (unsigned bz = 0; bz < grid.z; ++bz)
            for (unsigned by = 0; by < grid.y; ++by)
                for (unsigned bx = 0; bx < grid.x; ++bx) {
                    if (t == 0) std::memset(g_dyn_smem, 0xff, smem);
                    block_bar.arrive_and_wait();
                    tls.bid = make_uint3(bx, by, bz);
                    body();
                    block_bar.arrive_and_wait();
                }
    };
    std::vector<std::thread> threads;
    threads.reserve(nthreads);
    for (int t = 0; t < nthreads; ++t) threads.emplace_back(run, t);
    for (auto& th : threads) th.join();
}

// Registry of kernel instantiations by their name expression (the string given to NVRTC).
struct Entry {
    std::vector<int> arg_sizes;
    std::function<void(void**)> call;
};
inline std::map<std::string, Entry>& registry() {
    static std::map<std::string, Entry> r;
    return r;
}

template <typename... A, size_t... I>
inline void call_with(void (*k)(A...), void** args, std::index_sequence<I...>) {
    k(*static_cast<std::remove_reference_t<A>*>(args[I])...);
}

template <typename... A> inline bool add(const char* name, void (*k)(A...)) {
    Entry e;
    e.arg_sizes = {(int)sizeof(A)...};
    e.call = [k](void** args) { call_with(k, args, std::index_sequence_for<A...>{}); };
    registry()[name] = std::move(e);
    return true;
}

}  // namespace pkv_host

#define threadIdx (pkv_host::tls.tid)
#define blockIdx (pkv_host::tls.bid)
#define blockDim (pkv_host::g_block)
#define gridDim (pkv_host::g_grid)
#define PKV_DYNAMIC_SMEM(type, name) type* name = reinterpret_cast<type*>(pkv_host::g_dyn_smem)

inline void __syncthreads() { pkv_host::syncthreads(); }
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int = 32) {
    return pkv_host::shfl_from(mask, v, pkv_host::tls.lane ^ lane_mask);
}
template <typename T> inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
    return pkv_host::shfl_from(mask, v,
                               (pkv_host::tls.lane & ~(width - 1)) + (src_lane % width));
}
inline float __int_as_float(int x) {
    float f;
    std::memcpy(&f, &x, 4);
    return f;
}
inline int __float_as_int(float f) {
    int x;
    std::memcpy(&x, &f, 4);
    return x;
}
template <typename T> inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
template <typename T> inline T atomicMax(T* p, T v) {
    std::atomic_ref<T> a(*p);
    T old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}
template <typename T> inline T atomicCAS(T* p, T cmp, T v) {
    std::atomic_ref<T>(*p).compare_exchange_strong(cmp, v);
    return cmp;
}
template <typename T> inline T __ldg(const T* p) { return *p; }

#define PKV_CAT2(a, b) a##b
#define PKV_CAT(a, b) PKV_CAT2(a, b)
// Register one instantiation under its name expression: PKV_ENTRY(pkv_write_kv<float, 4>)
#define PKV_ENTRY(...) \
    static bool PKV_CAT(pkv_entry_, __COUNTER__) = pkv_host::add(#__VA_ARGS__, &__VA_ARGS__);

// Launch a registered kernel: args[i] points at the i-th argument's bytes (as for
// cuLaunchKernel); arg_sizes[i] must equal sizeof of the i-th parameter. Returns 0 on
// success, -1 for an unknown name, -2 for an argument count or size mismatch, -3 when the
// kernel misused a CUDA built-in (pkv_host_error() says how).
extern "C" int pkv_host_launch(const char* name, unsigned gx, unsigned gy, unsigned gz,
                               unsigned bx, unsigned by, unsigned bz, unsigned long long smem,
                               void** args, const int* arg_sizes, int nargs) {
    static std::mutex mu;
    std::lock_guard<std::mutex> lock(mu);
    auto it = pkv_host::registry().find(name);
    if (it == pkv_host::registry().end()) return -1;
    const pkv_host::Entry& e = it->second;
    if ((int)e.arg_sizes.size() != nargs) return -2;
    for (int i = 0; i < nargs; ++i)
        if (e.arg_sizes[i] != arg_sizes[i]) return -2;
    pkv_host::g_error.clear();
    pkv_host::launch(dim3(gx, gy, gz), dim3(bx, by, bz), smem, [&] { e.call(args); });
    return pkv_host::g_error.empty() ? 0 : -3;
}

// Why the last launch returned -3 (empty otherwise).
extern "C" const char* pkv_host_error() { return pkv_host::g_error.c_str(); }

extern "C" int pkv_host_has(const char* name) {
    return pkv_host::registry().count(name) ? 1 : 0;
}
