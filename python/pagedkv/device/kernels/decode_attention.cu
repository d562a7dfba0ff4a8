// Paged decode attention: one query token per sequence against its paged K/V history.
//
// grid = (num_splits, num_kv_heads, batch); block = (BDX, group, bdz) where
//   VEC = max(16 / sizeof(T), HEAD_DIM / 32) elements per thread (16-byte loads),
//   BDX = HEAD_DIM / VEC threads cover one row (one query head's dims, or one K/V row),
//   group = num_heads / num_kv_heads query heads of one KV head (GQA), one per threadIdx.y,
//   bdz token lanes that process different tokens of a tile in parallel.
// A CTA owns one (sequence, KV head, split): it stages a tile of tile_tokens K and V rows
// in shared memory (each row read from global memory once for the whole group), then
// every (query head, token lane) runs an online softmax in fp32 over its tokens (scores in
// the log2 domain: q is pre-scaled by scale * log2(e)). Token lanes are merged through
// shared memory at the end. With one split the CTA writes the output; with several it
// writes a normalised partial output and its log2-sum-exp, and pkv_merge_splits combines
// them (Flash-Decoding).
//
// Local attention (KV-cache groups, docs/semantics.md): with window > 0 the query at
// position seq_len - 1 attends only to the last `window` positions (FlashAttention's
// window_left = window - 1); with chunk > 0 only to its own chunk, positions >=
// (seq_len - 1) / chunk * chunk. The splits cover the attended span [lo, seq_len), and no
// table entry before lo is read: a group's manager puts the null block (0) there.
#include "common.cuh"

namespace pkv {
template <typename T, int HEAD_DIM> struct DecodeShape {
    static constexpr int VEC0 = 16 / (int)sizeof(T);
    static constexpr int VEC = VEC0 > HEAD_DIM / 32 ? VEC0 : HEAD_DIM / 32;
    static constexpr int BDX = HEAD_DIM / VEC;
};
}  // namespace pkv

template <typename T, int HEAD_DIM>
__global__ void __launch_bounds__(1024) pkv_paged_decode(
    const T* __restrict__ q, long long q_batch_stride, long long q_head_stride,
    const T* __restrict__ k_cache, const T* __restrict__ v_cache,
    const int* __restrict__ block_tables, long long bt_stride,
    const int* __restrict__ seq_lens, int window, int chunk, int num_kv_heads, int block_size, int num_blocks,
    int max_blocks, int tokens_per_split, int tile_tokens, float scale_log2, T* __restrict__ out,
    long long out_batch_stride, long long out_head_stride, float* __restrict__ part_o,
    float* __restrict__ part_lse) {
    typedef pkv::DecodeShape<T, HEAD_DIM> S;
    constexpr int VEC = S::VEC;
    constexpr int BDX = S::BDX;
    const int tx = threadIdx.x, g = threadIdx.y, z = threadIdx.z;
    const int group = blockDim.y, bdz = blockDim.z;
    const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
    const int num_splits = gridDim.x;
    const int num_heads = num_kv_heads * group;
    const int head = kvh * group + g;
    const int tid = tx + BDX * (g + group * z);
    const int nthreads = BDX * group * bdz;
    // The lanes of this thread's warp. A GQA group that cannot be padded to whole warps
    // (group * BDX not a multiple of 32 with no room to double bdz) ends the CTA in a
    // partial warp, and a full mask naming lanes that do not exist is undefined behaviour.
    // BDX divides 32 and nthreads, so the BDX lanes of one row stay inside the mask.
    const unsigned warp_mask = pkv::lanes_mask(nthreads - (tid & ~31));

    const int seq_len = seq_lens[b];
    // The first position the query attends to (0 for full attention).
    int lo = 0;
    if (seq_len > 0) {
        if (window > 0) lo = pkv::imax(lo, seq_len - window);
        if (chunk > 0) lo = pkv::imax(lo, (seq_len - 1) / chunk * chunk);
    }
    // A length the launch cannot honour (negative, past the table row, or an attended span
    // past what the splits cover: a device seq_lens longer than max_seq_len; the host
    // rejects host ones) reads nothing and gives NaN, never a read outside the table or a
    // silent truncation.
    const bool bad_len = seq_len < 0 ||
                         (long long)seq_len > (long long)max_blocks * block_size ||
                         (long long)(seq_len - lo) > (long long)tokens_per_split * num_splits;
    const int start = bad_len ? 0 : lo + split * tokens_per_split;
    const int end = bad_len ? 0 : pkv::imin(seq_len, start + tokens_per_split);

    float qv[VEC];
    {
        pkv::Vec<T, VEC> qq;
        qq.load(q + b * q_batch_stride + head * q_head_stride + tx * VEC);
#pragma unroll
        for (int i = 0; i < VEC; ++i) qv[i] = pkv::to_float(qq.e[i]) * scale_log2;
    }
    float o[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) o[i] = 0.0f;
    float m = pkv::neg_inf();
    float d = 0.0f;

    PKV_DYNAMIC_SMEM(unsigned char, smem_raw);
    T* k_s = reinterpret_cast<T*>(smem_raw);
    T* v_s = k_s + tile_tokens * HEAD_DIM;
    const long long row_stride = (long long)num_kv_heads * HEAD_DIM;
    const long long block_stride = row_stride * block_size;
    const int* table = block_tables + b * bt_stride;
    const T* k_base = k_cache + kvh * HEAD_DIM;
    const T* v_base = v_cache + kvh * HEAD_DIM;

    for (int t0 = start; t0 < end; t0 += tile_tokens) {
        const int n = pkv::imin(tile_tokens, end - t0);
        for (int u = tid; u < n * BDX; u += nthreads) {
            const int r = u / BDX;
            const int c = (u - r * BDX) * VEC;
            const int t = t0 + r;
            const int blk = table[t / block_size];
            pkv::Vec<T, VEC> kk, vv;
            if (blk >= 0 && blk < num_blocks) {
                const long long off = blk * block_stride + (t % block_size) * row_stride + c;
                kk.load(k_base + off);
                vv.load(v_base + off);
            } else {
                kk.zero();
                vv.zero();
            }
            kk.store(k_s + r * HEAD_DIM + c);
            vv.store(v_s + r * HEAD_DIM + c);
        }
        __syncthreads();
        const int iters = (n + bdz - 1) / bdz;  // the same in every thread: shuffles stay uniform
        for (int it = 0; it < iters; ++it) {
            const int r = it * bdz + z;
            const bool valid = r < n;
            float s = 0.0f;
            if (valid) {
                pkv::Vec<T, VEC> kk;
                kk.load(k_s + r * HEAD_DIM + tx * VEC);
#pragma unroll
                for (int i = 0; i < VEC; ++i) s += qv[i] * pkv::to_float(kk.e[i]);
            }
#pragma unroll
            for (int off = BDX / 2; off > 0; off >>= 1) s += __shfl_xor_sync(warp_mask, s, off);
            if (valid) {
                const float m_new = fmaxf(m, s);
                const float corr = exp2f(m - m_new);
                const float p = exp2f(s - m_new);
                d = d * corr + p;
                pkv::Vec<T, VEC> vv;
                vv.load(v_s + r * HEAD_DIM + tx * VEC);
#pragma unroll
                for (int i = 0; i < VEC; ++i) o[i] = o[i] * corr + p * pkv::to_float(vv.e[i]);
                m = m_new;
            }
        }
        __syncthreads();
    }

    // Merge the token lanes z = 0 .. bdz-1 of each query head (shared memory is free now).
    if (bdz > 1) {
        float* mo = reinterpret_cast<float*>(smem_raw);
        float* md = mo + nthreads * VEC;
        const int slot = g + group * z;
#pragma unroll
        for (int i = 0; i < VEC; ++i) mo[slot * HEAD_DIM + tx * VEC + i] = o[i];
        if (tx == 0) {
            md[2 * slot] = m;
            md[2 * slot + 1] = d;
        }
        __syncthreads();
        if (z == 0) {
            float mm = pkv::neg_inf();
            for (int zz = 0; zz < bdz; ++zz) mm = fmaxf(mm, md[2 * (g + group * zz)]);
            d = 0.0f;
#pragma unroll
            for (int i = 0; i < VEC; ++i) o[i] = 0.0f;
            if (mm != pkv::neg_inf()) {
                for (int zz = 0; zz < bdz; ++zz) {
                    const int sl = g + group * zz;
                    const float mz = md[2 * sl];
                    if (mz == pkv::neg_inf()) continue;
                    const float w = exp2f(mz - mm);
                    d += w * md[2 * sl + 1];
#pragma unroll
                    for (int i = 0; i < VEC; ++i) o[i] += w * mo[sl * HEAD_DIM + tx * VEC + i];
                }
            }
            m = mm;
        }
    }
    if (z != 0) return;  // no barrier follows

    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    const float nan = pkv::quiet_nan();
    if (num_splits == 1) {
        pkv::Vec<T, VEC> res;
#pragma unroll
        for (int i = 0; i < VEC; ++i) res.e[i] = pkv::from_float<T>(bad_len ? nan : o[i] * inv);
        res.store(out + b * out_batch_stride + head * out_head_stride + tx * VEC);
    } else {
        const long long pi = ((long long)b * num_heads + head) * num_splits + split;
        float* po = part_o + pi * HEAD_DIM + tx * VEC;
#pragma unroll
        for (int i = 0; i < VEC; ++i) po[i] = bad_len ? nan : o[i] * inv;
        // A finite weight for a bad sequence, so that the merge carries its NaN through.
        if (tx == 0)
            part_lse[pi] = bad_len ? 0.0f : d > 0.0f ? m + log2f(d) : pkv::neg_inf();
    }
}

// Combine the splits of each (sequence, query head): out = sum_i w_i o_i / sum_i w_i with
// w_i = 2^(lse_i - max lse). grid = (num_heads, batch); threads loop over head_dim.
template <typename T>
__global__ void __launch_bounds__(256) pkv_merge_splits(
    const float* __restrict__ part_o, const float* __restrict__ part_lse, int num_splits,
    int head_dim, T* __restrict__ out, long long out_batch_stride, long long out_head_stride) {
    const int head = blockIdx.x, b = blockIdx.y, num_heads = gridDim.x;
    const long long base = ((long long)b * num_heads + head) * num_splits;
    float mm = pkv::neg_inf();
    for (int i = 0; i < num_splits; ++i) mm = fmaxf(mm, part_lse[base + i]);
    T* dst = out + b * out_batch_stride + head * out_head_stride;
    for (int c = threadIdx.x; c < head_dim; c += blockDim.x) {
        float acc = 0.0f, wsum = 0.0f;
        if (mm != pkv::neg_inf()) {
            for (int i = 0; i < num_splits; ++i) {
                const float l = part_lse[base + i];
                if (l == pkv::neg_inf()) continue;
                const float w = exp2f(l - mm);
                wsum += w;
                acc += w * part_o[(base + i) * head_dim + c];
            }
        }
        dst[c] = pkv::from_float<T>(wsum > 0.0f ? acc / wsum : 0.0f);
    }
}
