// Cache kernels of the KV pool: write (scatter new tokens into slots), gather (paged to
// contiguous) and copy_blocks (copy-on-write pairs, and swap between two pools).
//
// Pool layout: one buffer [num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads,
// head_dim]; a layer's K (or V) view is contiguous, a token row (num_kv_heads * head_dim
// elements) is contiguous, and slot s of a layer starts at element s * row.
#include "common.cuh"

// write: key/value [num_tokens, num_heads, head_dim] with arbitrary token and head strides
// (last dim contiguous) into k_cache/v_cache at slot_mapping[token]; slot -1 (any negative
// slot) skips the token, slots >= num_slots are ignored (the host rejects them first), and
// so are slots below first_slot: block_size in a pool with KV-cache groups, whose block 0 is
// the null block (a position the group released maps there, and nothing may write it).
// One CTA per token in a grid-stride loop; the threads cover the row in VEC-element units.
template <typename T, int VEC>
__global__ void __launch_bounds__(256) pkv_write_kv(
    const T* __restrict__ key, const T* __restrict__ value,
    const long long* __restrict__ slot_mapping, T* __restrict__ k_cache,
    T* __restrict__ v_cache, int num_tokens, int num_heads, int head_dim,
    long long key_token_stride, long long key_head_stride, long long value_token_stride,
    long long value_head_stride, long long num_slots, long long first_slot) {
    const int units_per_head = head_dim / VEC;
    const int units = num_heads * units_per_head;
    const long long row = (long long)num_heads * head_dim;
    for (int tok = blockIdx.x; tok < num_tokens; tok += gridDim.x) {
        const long long slot = slot_mapping[tok];
        if (slot < first_slot || slot < 0 || slot >= num_slots) continue;
        T* kdst = k_cache + slot * row;
        T* vdst = v_cache + slot * row;
        const T* ksrc = key + tok * key_token_stride;
        const T* vsrc = value + tok * value_token_stride;
        for (int u = threadIdx.x; u < units; u += blockDim.x) {
            const int h = u / units_per_head;
            const int c = (u - h * units_per_head) * VEC;
            pkv::Vec<T, VEC> kv, vv;
            kv.load(ksrc + h * key_head_stride + c);
            vv.load(vsrc + h * value_head_stride + c);
            kv.store(kdst + h * head_dim + c);
            vv.store(vdst + h * head_dim + c);
        }
    }
}

// gather: for each sequence i (cu_seq_lens[i] .. cu_seq_lens[i+1] in the output), token
// position p reads slot block_tables[i * bt_stride + p / block_size] * block_size +
// p % block_size. Output rows are contiguous [total_tokens, row_units * VEC]. A block id
// outside [0, num_blocks), or a position outside the sequence's table row of max_blocks
// entries (a bad device cu_seq_lens: the host checks host ones first), gives a zero row,
// never a read outside the pool or the table.
template <typename T, int VEC>
__global__ void __launch_bounds__(256) pkv_gather_kv(
    const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_tables, long long bt_stride,
    const int* __restrict__ cu_seq_lens, int batch, T* __restrict__ out_k,
    T* __restrict__ out_v, int total_tokens, int row_units, int block_size, int num_blocks,
    int max_blocks) {
    const long long row = (long long)row_units * VEC;
    for (int tok = blockIdx.x; tok < total_tokens; tok += gridDim.x) {
        // The sequence that holds output row tok: the last i with cu_seq_lens[i] <= tok.
        int lo = 0, hi = batch - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (cu_seq_lens[mid] <= tok) lo = mid; else hi = mid - 1;
        }
        const int pos = tok - cu_seq_lens[lo];
        const bool in_row = pos >= 0 && (long long)pos < (long long)max_blocks * block_size;
        const int blk = in_row ? block_tables[lo * bt_stride + pos / block_size] : -1;
        const bool ok = blk >= 0 && blk < num_blocks;
        const long long src = ((long long)blk * block_size + pos % block_size) * row;
        T* kdst = out_k + tok * row;
        T* vdst = out_v + tok * row;
        for (int u = threadIdx.x; u < row_units; u += blockDim.x) {
            pkv::Vec<T, VEC> kv, vv;
            if (ok) {
                kv.load(k_cache + src + u * VEC);
                vv.load(v_cache + src + u * VEC);
            } else {
                kv.zero();
                vv.zero();
            }
            kv.store(kdst + u * VEC);
            vv.store(vdst + u * VEC);
        }
    }
}

// copy_blocks: for each pair (src, dst) of pairs[num_pairs][2] and each of num_planes
// planes (layer x K/V), copy one block of block_units N-byte units from the source pool to
// the destination pool (the same pool for copy-on-write; the GPU and the pinned CPU pool,
// mapped into the device's address space, for swap). A plane of the source holds
// src_num_blocks blocks, of the destination dst_num_blocks. Pairs with an id out of range
// are skipped (the host rejects them first). One work item per (pair, plane), grid-stride.
template <int N>
__global__ void __launch_bounds__(256) pkv_copy_blocks(
    const typename pkv::Chunk<N>::type* __restrict__ src,
    typename pkv::Chunk<N>::type* __restrict__ dst, const int* __restrict__ pairs,
    int num_pairs, int num_planes, int block_units, int src_num_blocks, int dst_num_blocks) {
    typedef typename pkv::Chunk<N>::type U;
    const long long items = (long long)num_pairs * num_planes;
    for (long long w = blockIdx.x; w < items; w += gridDim.x) {
        const int pair = (int)(w / num_planes);
        const int plane = (int)(w - (long long)pair * num_planes);
        const int s = pairs[2 * pair];
        const int d = pairs[2 * pair + 1];
        if (s < 0 || s >= src_num_blocks || d < 0 || d >= dst_num_blocks) continue;
        const U* sp = src + ((long long)plane * src_num_blocks + s) * block_units;
        U* dp = dst + ((long long)plane * dst_num_blocks + d) * block_units;
        // Four independent loads in flight per thread before the stores.
        int u = threadIdx.x;
        const int step = blockDim.x;
        for (; u + 3 * step < block_units; u += 4 * step) {
            const U a = sp[u], b = sp[u + step], c = sp[u + 2 * step], e = sp[u + 3 * step];
            dp[u] = a;
            dp[u + step] = b;
            dp[u + 2 * step] = c;
            dp[u + 3 * step] = e;
        }
        for (; u < block_units; u += step) dp[u] = sp[u];
    }
}
