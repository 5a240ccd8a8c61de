// The score-consistency probe (score_consistency.h): one warpgroup CTA per (tile pair, query head)
// stages the 64-query tile and the 128-key block into 128B-swizzled shared tiles with plain stores,
// computes S in the forward's orientation and S^T in the backward's, and compares the bits.
//
// The tile and step geometry comes from the kernels' own shared-memory layouts (fwd_smem.cuh,
// bwd_smem.cuh), so the probe follows them if they change; what it cannot share is the loop that
// issues the products (the kernels' run on their SharedStorage), which is mirrored below.
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "arch.cuh"
#include "attention_internal.h"
#include "bwd_smem.cuh"
#include "check.h"
#include "device_buffer.h"
#include "flamia/attention_gpu.h"
#include "fwd_smem.cuh"
#include "proxy_fence.cuh"
#include "quantize_outputs.h"
#include "score_consistency.h"
#include "wgmma.cuh"

namespace flamia::sm90 {
namespace {

using fwd::ScoreOperand;

// One backward query tile, which is also one forward consumer warpgroup's rows, against one key
// block of both kernels; the backward splits the block between two warpgroups of kHalfKeys.
constexpr int kQueries = bwd::kBlockM;
constexpr int kKeys = fwd::kBlockN;
constexpr int kHalves = 2;
constexpr int kHalfKeys = kKeys / kHalves;
constexpr int kHeadDim = fwd::kHeadDim;
static_assert(bwd::kBlockN == kKeys, "both kernels' key blocks");
static_assert(bwd::kHeadDim == kHeadDim, "one head dim for both kernels");
static_assert(kQueries == wgmma::kM && kHalfKeys == wgmma::kM,
              "a forward warpgroup's queries and a backward warpgroup's keys are one wgmma M");
static_assert(fwd::kBlockM % kQueries == 0,
              "a forward query tile is whole warpgroup tiles, aligned like the backward's");

constexpr uint32_t kChunkBytes = 16;  // one vector load and store
constexpr uint32_t kChunksPerSpan = wgmma::kSw128RowBytes / kChunkBytes;

// Both kernels walk the head dim in the same spans and steps (fwd::ScoreSpans).
template <ScoreOperand kScore>
struct ProbeLayout : fwd::ScoreSpans<kScore> {
  using Fwd = fwd::SmemLayout<kScore>;
  using Bwd = bwd::SmemLayout<kScore>;
  static constexpr int kSpans = fwd::ScoreSpans<kScore>::kSpans;
  static constexpr uint32_t kRowBytes = kSpans * wgmma::kSw128RowBytes;  // a (token, head) row
  static constexpr uint32_t kQSpanBytes = Fwd::kWarpgroupQBytes;  // kQueries rows of one span
  static constexpr uint32_t kKSpanBytes = Fwd::kKSpanBytes;       // kKeys rows of one span
  static constexpr uint32_t kHalfKeyBytes = Bwd::kWarpgroupKeyBytes;
  static_assert(Bwd::kQSpanBytes == kQSpanBytes && Bwd::kKSpanBytes == kKSpanBytes,
                "both kernels' tiles of one span");
  static_assert(kRowBytes == kHeadDim * fwd::ScoreSpans<kScore>::kElemBytes,
                "a row is the head dim");
};

template <ScoreOperand kScore>
struct alignas(wgmma::kSw128AtomBytes) ProbeStorage {
  using L = ProbeLayout<kScore>;
  uint8_t q_forward[L::kSpans * L::kQSpanBytes];
  uint8_t q_backward[L::kSpans * L::kQSpanBytes];
  uint8_t k[L::kSpans * L::kKSpanBytes];
  uint32_t forward_bits[kQueries][kKeys];  // the forward orientation's S, for the comparison
};

// Dynamic shared memory is only 16 B aligned: allocate slack and align up.
template <ScoreOperand kScore>
constexpr size_t kSmemBytes = sizeof(ProbeStorage<kScore>) + wgmma::kSw128AtomBytes;

// Rows of one operand in global memory: (token, head) starts at
// base + token * token_stride + head * head_stride bytes, ProbeLayout::kRowBytes long.
struct OperandRows {
  const uint8_t* base = nullptr;
  int64_t token_stride = 0;
  int64_t head_stride = 0;
};

// Document-relative tiles: queries [q_tile * kQueries, +kQueries), keys [key_block * kKeys,
// +kKeys).
struct TilePair {
  int32_t doc;
  int32_t q_tile;
  int32_t key_block;
};

enum Counter { kEntries, kDiffering, kNumCounters };

struct ProbeParams {
  OperandRows q_forward, q_backward, k;
  const TilePair* pairs = nullptr;
  const int32_t* cu_seqlens = nullptr;
  int group = 1;  // query heads per key head
  bool causal = false;
  unsigned long long* counters = nullptr;  // [kNumCounters]
};

// Stages rows [row0, row0 + kRows) of the document's operand rows of `head` as kSpans K-major
// 128B-swizzled tiles of kRows x 128 B (as the kernels' TMA writes them); rows at or past `length`
// are zero.
template <ScoreOperand kScore, int kRows>
__device__ void stage_rows(uint8_t* tile, const OperandRows& src, int64_t doc_begin, int row0,
                           int length, int head) {
  constexpr uint32_t kChunksPerRow = ProbeLayout<kScore>::kRowBytes / kChunkBytes;
  constexpr uint32_t kSpanBytes = kRows * wgmma::kSw128RowBytes;
  for (uint32_t c = threadIdx.x; c < kRows * kChunksPerRow; c += blockDim.x) {
    const int row = int(c / kChunksPerRow);
    const uint32_t chunk = c % kChunksPerRow;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row0 + row < length)
      v = *reinterpret_cast<const uint4*>(src.base + (doc_begin + row0 + row) * src.token_stride +
                                          head * src.head_stride + chunk * kChunkBytes);
    *reinterpret_cast<uint4*>(tile + (chunk / kChunksPerSpan) * kSpanBytes +
                              wgmma::sw128_offset(row, (chunk % kChunksPerSpan) * kChunkBytes)) = v;
  }
}

// The forward's S tile (issue_score_product): A = the 64 queries, B = the 128 keys, one m64n128
// product per k step, spans in order.
template <ScoreOperand kScore>
__device__ void forward_scores(float (&s)[wgmma::acc_regs(kKeys)], const ProbeStorage<kScore>& sm) {
  using L = ProbeLayout<kScore>;
  wgmma::fence_operands(s);
  wgmma::fence();
  fwd::issue_score_steps<kScore, kKeys>(s, sm.q_forward, L::kQSpanBytes, sm.k, L::kKSpanBytes);
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_operands(s);
}

// The backward's S^T tile of one warpgroup (issue_score_products): A = keys [64 half, +64) of the
// block, B = the 64 queries, one m64n64 product per k step, spans in order.
template <ScoreOperand kScore>
__device__ void backward_scores(float (&st)[wgmma::acc_regs(kQueries)],
                                const ProbeStorage<kScore>& sm, int half) {
  using L = ProbeLayout<kScore>;
  wgmma::fence_operands(st);
  wgmma::fence();
  fwd::issue_score_steps<kScore, kQueries>(st, sm.k + half * L::kHalfKeyBytes, L::kKSpanBytes,
                                           sm.q_backward, L::kQSpanBytes);
  wgmma::commit();
  wgmma::wait<0>();
  wgmma::fence_operands(st);
}

// Grid: (pair, query head); one warpgroup.
template <ScoreOperand kScore>
__global__ void __launch_bounds__(kWarpgroupThreads)
    score_consistency_kernel(const __grid_constant__ ProbeParams p) {
  extern __shared__ uint8_t smem_raw[];
  const uint32_t misalign =
      static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw)) % wgmma::kSw128AtomBytes;
  ProbeStorage<kScore>& sm = *reinterpret_cast<ProbeStorage<kScore>*>(
      smem_raw + (wgmma::kSw128AtomBytes - misalign) % wgmma::kSw128AtomBytes);

  const TilePair pair = p.pairs[blockIdx.x];
  const int head = int(blockIdx.y);
  const int64_t begin = p.cu_seqlens[pair.doc];
  const int length = int(p.cu_seqlens[pair.doc + 1] - begin);
  const int q0 = pair.q_tile * kQueries;
  const int k0 = pair.key_block * kKeys;
  stage_rows<kScore, kQueries>(sm.q_forward, p.q_forward, begin, q0, length, head);
  stage_rows<kScore, kQueries>(sm.q_backward, p.q_backward, begin, q0, length, head);
  stage_rows<kScore, kKeys>(sm.k, p.k, begin, k0, length, head / p.group);
  fence_async_shared();  // plain stores -> wgmma's async-proxy reads
  __syncthreads();

  const int t = int(threadIdx.x);
  {
    float s[wgmma::acc_regs(kKeys)];
    forward_scores<kScore>(s, sm);
#pragma unroll
    for (int i = 0; i < wgmma::acc_regs(kKeys); ++i)
      sm.forward_bits[wgmma::acc_row(t, i)][wgmma::acc_col(t, i)] = __float_as_uint(s[i]);
  }
  __syncthreads();

  uint32_t counts[kNumCounters] = {};
#pragma unroll
  for (int half = 0; half < kHalves; ++half) {
    float st[wgmma::acc_regs(kQueries)];
    backward_scores<kScore>(st, sm, half);
#pragma unroll
    for (int i = 0; i < wgmma::acc_regs(kQueries); ++i) {
      const int key = half * kHalfKeys + wgmma::acc_row(t, i);
      const int query = wgmma::acc_col(t, i);
      const int key_pos = k0 + key;
      const int query_pos = q0 + query;
      if (query_pos >= length || key_pos >= length || (p.causal && key_pos > query_pos)) continue;
      ++counts[kEntries];
      counts[kDiffering] += __float_as_uint(st[i]) != sm.forward_bits[query][key];
    }
  }
#pragma unroll
  for (int c = 0; c < kNumCounters; ++c) {
    const uint32_t warp_total = __reduce_add_sync(~0u, counts[c]);
    if (lane_index() == 0) atomicAdd(p.counters + c, (unsigned long long)warp_total);
  }
}

[[noreturn]] void reject(const std::string& what) {
  throw Error("score consistency: " + what);
}

void require_device_pointer(const void* ptr, const std::string& name) {
  if (ptr == nullptr) reject(name + " is null");
  if (reinterpret_cast<uintptr_t>(ptr) % kChunkBytes != 0)
    reject(name + " is not " + std::to_string(kChunkBytes) + "-byte aligned");
}

// E4M3 codes [T][heads][D].
OperandRows codes_rows(const uint8_t* codes, int heads, const std::string& name) {
  require_device_pointer(codes, name);
  return {codes, int64_t(heads) * kHeadDim, kHeadDim};
}

OperandRows bf16_rows(const TokenTensor<const uint16_t>& v, const PackedLayout& layout, int heads,
                      const std::string& name) {
  require_device_pointer(v.data, name);
  validate_view(name.c_str(), v, layout.tokens, heads, layout.head_dim);
  const int64_t token_stride = v.stride_token * int64_t(sizeof(uint16_t));
  const int64_t head_stride = v.stride_head * int64_t(sizeof(uint16_t));
  if (token_stride % kChunkBytes != 0 || head_stride % kChunkBytes != 0)
    reject(name + "'s token and head strides must be multiples of " + std::to_string(kChunkBytes) +
           " bytes");
  return {reinterpret_cast<const uint8_t*>(v.data), token_stride, head_stride};
}

// Every (document, query tile, key block) with a visible entry: causal, the query tiles from the
// one holding the block's first key, as the backward's work items visit them.
std::vector<TilePair> visible_pairs(const PackedLayout& layout, bool causal) {
  std::vector<TilePair> pairs;
  for (int doc = 0; doc < layout.num_docs; ++doc) {
    const int length = layout.doc_length(doc);
    const int tiles = (length + kQueries - 1) / kQueries;
    const int blocks = (length + kKeys - 1) / kKeys;
    for (int block = 0; block < blocks; ++block)
      for (int tile = bwd::first_query_tile(block, causal); tile < tiles; ++tile)
        pairs.push_back({doc, tile, block});
  }
  return pairs;
}

constexpr int kMaxGridY = 65535;

template <ScoreOperand kScore>
void launch_probe(const ProbeParams& p, int pairs, int heads, cudaStream_t stream) {
  FLAMIA_CUDA_CHECK(cudaFuncSetAttribute(score_consistency_kernel<kScore>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         int(kSmemBytes<kScore>)));
  score_consistency_kernel<kScore>
      <<<dim3(pairs, heads), kWarpgroupThreads, kSmemBytes<kScore>, stream>>>(p);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

}  // namespace

ScoreConsistency score_consistency_gpu(const PackedLayout& layout, const int32_t* device_cu_seqlens,
                                       Recipe recipe, bool causal, const DeviceAttentionInputs& in,
                                       const DeviceQuantizedAttention& quant, cudaStream_t stream,
                                       const BackwardQueryOverride* backward_q) {
  validate(layout);
  if (layout.head_dim != kHeadDim)
    reject("head dim " + std::to_string(layout.head_dim) + " is not built (only " +
           std::to_string(kHeadDim) + ")");
  if (recipe != Recipe::kMxfp8 && recipe != Recipe::kMxfp8Qk16)
    reject(std::string("recipe ") + to_string(recipe) + " is not probed (mxfp8, mxfp8-qk16 only)");
  if (device_cu_seqlens == nullptr) reject("device cu_seqlens is null");
  if (layout.heads_q > kMaxGridY)
    reject("more than " + std::to_string(kMaxGridY) + " query heads (the grid's y extent)");

  const ScoreOperand operand = recipe == Recipe::kMxfp8 ? ScoreOperand::kE4m3 : ScoreOperand::kBf16;
  ProbeParams p;
  if (operand == ScoreOperand::kE4m3) {
    p.q_forward = codes_rows(quant.q.codes, layout.heads_q, "Q codes");
    p.k = codes_rows(quant.k.codes, layout.heads_kv, "K codes");
    p.q_backward = backward_q == nullptr
                       ? p.q_forward
                       : codes_rows(backward_q->codes, layout.heads_q, "backward Q codes");
  } else {
    p.q_forward = bf16_rows(in.q, layout, layout.heads_q, "Q (BF16)");
    p.k = bf16_rows(in.k, layout, layout.heads_kv, "K (BF16)");
    p.q_backward = backward_q == nullptr
                       ? p.q_forward
                       : bf16_rows(backward_q->bf16, layout, layout.heads_q, "backward Q (BF16)");
  }

  const std::vector<TilePair> pairs = visible_pairs(layout, causal);
  if (pairs.empty()) return {};
  if (pairs.size() > size_t(INT_MAX)) reject("too many tile pairs for one grid");

  cuda::DeviceBuffer pair_buffer(pairs.size() * sizeof(TilePair));
  cuda::DeviceBuffer counter_buffer(kNumCounters * sizeof(unsigned long long));
  FLAMIA_CUDA_CHECK(cudaMemcpyAsync(pair_buffer.get(), pairs.data(), pair_buffer.bytes(),
                                    cudaMemcpyHostToDevice, stream));
  FLAMIA_CUDA_CHECK(cudaMemsetAsync(counter_buffer.get(), 0, counter_buffer.bytes(), stream));
  p.pairs = pair_buffer.get<TilePair>();
  p.cu_seqlens = device_cu_seqlens;
  p.group = layout.group();
  p.causal = causal;
  p.counters = counter_buffer.get<unsigned long long>();
  if (operand == ScoreOperand::kE4m3) {
    launch_probe<ScoreOperand::kE4m3>(p, int(pairs.size()), layout.heads_q, stream);
  } else {
    launch_probe<ScoreOperand::kBf16>(p, int(pairs.size()), layout.heads_q, stream);
  }
  unsigned long long counts[kNumCounters] = {};
  FLAMIA_CUDA_CHECK(cudaMemcpyAsync(counts, counter_buffer.get(), sizeof(counts),
                                    cudaMemcpyDeviceToHost, stream));
  FLAMIA_CUDA_CHECK(cudaStreamSynchronize(stream));
  ScoreConsistency result;
  result.entries = int64_t(counts[kEntries]);
  result.differing = int64_t(counts[kDiffering]);
  return result;
}

}  // namespace flamia::sm90

namespace flamia {

ScoreConsistencyReport score_consistency_to_host(const AttentionBatch& batch,
                                                 const GpuAttentionOptions& options) {
  const PackedLayout pl = batch.layout();
  check_gpu_support(pl, options);
  const gpu_attention::DeviceBatch dev(batch, /*with_dout=*/false);
  const DeviceAttentionInputs& in = dev.in;
  QuantizeOptions qo;
  qo.policy = options.policy;
  qo.hadamard = options.hadamard;
  qo.transposed = false;
  const cuda::QuantizeOutputs quant(pl, qo, false);
  quantize_gpu(in, qo, quant.view(), nullptr);
  const sm90::ScoreConsistency c =
      sm90::score_consistency_gpu(pl, dev.cu.get<int32_t>(), options.recipe,
                                  options.attention.causal, in, quant.view(), nullptr);
  quant.non_finite().throw_if_any();
  return {c.entries, c.differing};
}

}  // namespace flamia
