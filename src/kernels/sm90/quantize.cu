// quantize_gpu: host-side validation and the launch of the fused quantizer (quantize_tile.cuh).
#include <array>
#include <climits>
#include <cstdint>
#include <string>

#include "check.h"
#include "flamia/quantize_gpu.h"
#include "quantize_tile.cuh"
#include "tile_codes.h"

namespace flamia {
namespace {

using sm90::quant::KernelArgs;
using sm90::quant::kThreads;
using sm90::quant::OperandArgs;

using cuda::is_aligned;

void require_output(const char* operand, const char* array, const void* p) {
  const std::string name = std::string(operand) + " output '" + array + "'";
  if (p == nullptr) throw Error(name + " is null");
  if (!is_aligned(p, kDeviceAlignment))
    throw Error(name + " is not " + std::to_string(kDeviceAlignment) + "-byte aligned");
}

void require_vector_input(const char* name, const TokenTensor<const uint16_t>& v) {
  constexpr int64_t kElems = kDeviceAlignment / int64_t(sizeof(uint16_t));
  if (!is_aligned(v.data, kDeviceAlignment) || v.stride_token % kElems != 0 ||
      v.stride_head % kElems != 0)
    throw Error(std::string(name) + " must start " + std::to_string(kDeviceAlignment) +
                "-byte aligned with token and head strides that are multiples of " +
                std::to_string(kElems) + " elements (stride_token " +
                std::to_string(v.stride_token) + ", stride_head " + std::to_string(v.stride_head) +
                ")");
}

// The document tiling's list: slot -> the tokens [x, y) of its tile (x < 0: idle).
__global__ void document_tiles_kernel(const int32_t* cu_seqlens, int num_docs, int tile, int slots,
                                      int2* out) {
  const int slot = int(blockIdx.x * blockDim.x + threadIdx.x);
  if (slot >= slots) return;
  const sm90::quant::TileRange r = sm90::quant::document_tile(
      [&](int b) { return __ldg(cu_seqlens + b); }, num_docs, tile, slot);
  out[slot] = make_int2(r.t0, r.t_end);
}

using sm90::quant::Tiles;

template <int kDim, bool kRotate, Tiles kTiles>
void launch(const KernelArgs& args, int tiles, cudaStream_t stream) {
  sm90::quant::quantize_kernel<kDim, kRotate, kTiles><<<tiles, kThreads, 0, stream>>>(args);
  FLAMIA_CUDA_CHECK_LAUNCH();
}

template <Tiles kTiles>
void launch_for(int dim, bool rotate, const KernelArgs& args, int tiles, cudaStream_t stream) {
  constexpr int kSmallDim = 64, kLargeDim = 128;
  if (dim == kSmallDim) {
    rotate ? launch<kSmallDim, true, kTiles>(args, tiles, stream)
           : launch<kSmallDim, false, kTiles>(args, tiles, stream);
  } else {
    rotate ? launch<kLargeDim, true, kTiles>(args, tiles, stream)
           : launch<kLargeDim, false, kTiles>(args, tiles, stream);
  }
}

void launch_for(int dim, bool rotate, const KernelArgs& args, int tiles, cudaStream_t stream) {
  args.document_tiles != nullptr ? launch_for<Tiles::kDocument>(dim, rotate, args, tiles, stream)
                                 : launch_for<Tiles::kPacked>(dim, rotate, args, tiles, stream);
}

// The tiling quantize_gpu takes, and whether its launch writes the tile codes: one look at the
// layout (cu_seqlens in host memory) for both.
struct TilePlan {
  QuantizerTiling tiling;
  bool fused_tiles;
};

TilePlan plan_tiles(const PackedLayout& layout, const QuantizeOptions& options) {
  const int tile = sm90::quant::tile_tokens(layout.head_dim);
  const bool key_tiles = sm90::quant::tiles_are_key_tiles(layout.cu_seqlens, layout.num_docs,
                                                          layout.tokens, layout.head_dim);
  QuantizerTiling tiling = options.tiling;
  if (tiling == QuantizerTiling::kAuto) {
    // The document tiles win while they are at most 3/2 as many as the packed ones: equal
    // documents of 100-436 tokens (1.17-1.28 times) quantize 6-18 % faster, of 163 tokens (1.56)
    // as fast, of 80 and fewer (1.6 and more) slower (docs/PERF.md, item 132).
    constexpr int64_t kMaxTilesNum = 3, kMaxTilesDen = 2;
    const int64_t packed = (layout.tokens + tile - 1) / tile;
    int64_t document = 0;
    for (int b = 0; b < layout.num_docs && !key_tiles; ++b)
      document += (layout.doc_length(b) + tile - 1) / tile;
    tiling = layout.tokens == 0 || key_tiles || kMaxTilesDen * document > kMaxTilesNum * packed
                 ? QuantizerTiling::kPacked
                 : QuantizerTiling::kDocument;
  }
  const bool key_tile_size = tile == kKeyTileTokens;
  return {tiling, key_tile_size && (tiling == QuantizerTiling::kDocument || key_tiles)};
}

}  // namespace

QuantizerTiling quantize_gpu_tiling(const PackedLayout& layout, const QuantizeOptions& options) {
  return plan_tiles(layout, options).tiling;
}

bool quantize_gpu_fuses_tile_codes(const PackedLayout& layout, const QuantizeOptions& options) {
  return plan_tiles(layout, options).fused_tiles;
}

void quantize_gpu(const DeviceAttentionInputs& in, const QuantizeOptions& options,
                  const DeviceQuantizedAttention& out, cudaStream_t stream) {
  const PackedLayout& pl = in.layout;
  validate(pl);
  const std::array<bool, kNumOperands> present = present_operands(in);
  if (in.cu_seqlens == nullptr) throw Error("device cu_seqlens is null");
  if (out.non_finite_first == nullptr) throw Error("non_finite_first (the status array) is null");
  if (!is_aligned(out.non_finite_first, sizeof(int64_t)))
    throw Error("non_finite_first is not 8-byte aligned");

  struct Job {
    Operand id;
    const char* name;
    TokenTensor<const uint16_t> view;
    int heads;
    const DeviceE4M3Operand* dst;
    const DeviceNvfp4Operand* nv;  // null: no NVFP4 for this operand
  };
  const DeviceNvfp4Operand* q4 = options.nvfp4_qk ? &out.q4 : nullptr;
  const DeviceNvfp4Operand* k4 = options.nvfp4_qk ? &out.k4 : nullptr;
  const Job all[kNumOperands] = {{Operand::kQ, "Q", in.q, pl.heads_q, &out.q, q4},
                                 {Operand::kK, "K", in.k, pl.heads_kv, &out.k, k4},
                                 {Operand::kV, "V", in.v, pl.heads_kv, &out.v, nullptr},
                                 {Operand::kDO, "dO", in.dout, pl.heads_q, &out.dout, nullptr}};
  // Only the present operands get tiles (in both launches of the tensor policy); a skipped one's
  // outputs are neither checked nor touched, and its status entry stays -1.
  Job jobs[kNumOperands];
  int num_ops = 0;
  for (const Job& j : all) {
    if (!present[int(j.id)]) continue;
    validate_view(j.name, j.view, pl.tokens, j.heads, pl.head_dim);
    jobs[num_ops++] = j;
  }

  KernelArgs args;
  args.num_ops = num_ops;
  args.tokens = pl.tokens;
  const QuantLayout layout = QuantLayout::make(pl.tokens, 1, pl.head_dim, pl.num_docs);
  args.tokens_padded = layout.tokens_padded;
  args.tokens_t = layout.tokens_t;
  args.cu_seqlens = in.cu_seqlens;
  args.num_docs = pl.num_docs;
  args.non_finite = reinterpret_cast<unsigned long long*>(out.non_finite_first);
  const int tile = sm90::quant::tile_tokens(pl.head_dim);
  const TilePlan plan = plan_tiles(pl, options);
  const bool document_tiling = plan.tiling == QuantizerTiling::kDocument;
  // A head's tiles: packed, or the document tiling's slots (some idle).
  const int64_t head_tiles = document_tiling
                                 ? sm90::quant::document_slot_count(pl.tokens, pl.num_docs, tile)
                                 : (pl.tokens + tile - 1) / tile;
  // The quantizer writes the tile codes itself where its tiles are the key tiles (no pass
  // re-reading the codes: docs/PERF.md, items 118 and 130).
  const bool fused_tiles = plan.fused_tiles;
  int64_t tiles = 0;
  for (int i = 0; i < num_ops; ++i) {
    const Job& j = jobs[i];
    const ScalePolicy policy = effective_policy(options.policy, j.id);
    OperandArgs& o = args.ops[i];
    o.in = j.view.data;
    o.stride_token = j.view.stride_token;
    o.stride_head = j.view.stride_head;
    o.heads = j.heads;
    o.policy = policy;
    o.rotate = options.hadamard && (j.id == Operand::kQ || j.id == Operand::kK);
    const bool codes = writes_codes(options, j.id);
    o.codes = codes ? j.dst->codes : nullptr;
    o.codes_t = options.transposed ? j.dst->codes_t : nullptr;
    o.exponents = j.dst->exponents;
    o.channel_exponents = policy == ScalePolicy::kVGroup16 ? j.dst->channel_exponents : nullptr;
    if (fused_tiles) {
      o.codes_tiles = writes_codes_tiles(options, j.id) ? j.dst->codes_tiles : nullptr;
      o.codes_t_tiles = writes_codes_t_tiles(options, j.id) ? j.dst->codes_t_tiles : nullptr;
    }
    if (j.nv != nullptr) {
      o.nv_packed = j.nv->packed;
      o.nv_scales = j.nv->local_scales;
      o.nv_exponents = j.nv->exponents;
    }
    o.first_tile = int(tiles);
    o.slot = int(j.id);
    tiles += head_tiles * j.heads;
    if (pl.tokens == 0) {  // every array is empty but codes_t, which documents make all padding
      if (options.transposed && layout.tokens_t > 0) require_output(j.name, "codes_t", o.codes_t);
      if (writes_codes_t_tiles(options, j.id) && layout.tokens_t > 0)
        require_output(j.name, "codes_t_tiles", j.dst->codes_t_tiles);
      continue;
    }
    require_vector_input(j.name, j.view);
    if (codes) require_output(j.name, "codes", o.codes);
    require_output(j.name, "exponents", o.exponents);
    if (options.transposed) require_output(j.name, "codes_t", o.codes_t);
    if (policy == ScalePolicy::kVGroup16)
      require_output(j.name, "channel_exponents", o.channel_exponents);
    if (writes_codes_t_tiles(options, j.id))
      require_output(j.name, "codes_t_tiles", j.dst->codes_t_tiles);
    if (writes_codes_tiles(options, j.id))
      require_output(j.name, "codes_tiles", j.dst->codes_tiles);
    if (j.nv != nullptr) {
      const std::string nv_name = std::string(j.name) + " (NVFP4)";
      require_output(nv_name.c_str(), "packed", o.nv_packed);
      require_output(nv_name.c_str(), "local_scales", o.nv_scales);
      require_output(nv_name.c_str(), "exponents", o.nv_exponents);
    }
  }
  if (tiles > INT_MAX) throw Error("too many tokens x heads for one launch");

  // All ones is -1 as int64 and the largest value for the kernel's unsigned atomicMin.
  constexpr int kAllOnes = 0xFF;
  FLAMIA_CUDA_CHECK(
      cudaMemsetAsync(out.non_finite_first, kAllOnes, kNumOperands * sizeof(int64_t), stream));
  if (pl.tokens == 0) {  // no tokens: codes_t (documents with no tokens) holds zeros only
    if (options.transposed && layout.tokens_t > 0)
      for (int i = 0; i < num_ops; ++i) {
        const size_t bytes = size_t(args.ops[i].heads) * pl.head_dim * layout.tokens_t;
        FLAMIA_CUDA_CHECK(cudaMemsetAsync(args.ops[i].codes_t, 0, bytes, stream));
        if (writes_codes_t_tiles(options, jobs[i].id))
          FLAMIA_CUDA_CHECK(cudaMemsetAsync(jobs[i].dst->codes_t_tiles, 0, bytes, stream));
      }
    return;
  }

  // The rotated instantiation (fewer CTAs per SM) only where Q or K is among the operands: not for
  // the training call's dO alone.
  bool rotate = false;
  for (int i = 0; i < num_ops; ++i) rotate = rotate || args.ops[i].rotate;
  int2* document_tiles = nullptr;
  if (document_tiling) {
    constexpr int kListThreads = 256;
    FLAMIA_CUDA_CHECK(cudaMallocAsync(&document_tiles, head_tiles * sizeof(int2), stream));
    document_tiles_kernel<<<int((head_tiles + kListThreads - 1) / kListThreads), kListThreads, 0,
                            stream>>>(in.cu_seqlens, pl.num_docs, tile, int(head_tiles),
                                      document_tiles);
    FLAMIA_CUDA_CHECK_LAUNCH();
    args.document_tiles = document_tiles;
  }
  if (options.policy == ScalePolicy::kTensor) {
    void* workspace = nullptr;
    const size_t bytes = kNumOperands * sizeof(unsigned);
    FLAMIA_CUDA_CHECK(cudaMallocAsync(&workspace, bytes, stream));
    FLAMIA_CUDA_CHECK(cudaMemsetAsync(workspace, 0, bytes, stream));
    args.tensor_amax = static_cast<unsigned*>(workspace);
    args.amax_only = true;
    launch_for(pl.head_dim, rotate, args, int(tiles), stream);
    args.amax_only = false;
    launch_for(pl.head_dim, rotate, args, int(tiles), stream);
    FLAMIA_CUDA_CHECK(cudaFreeAsync(workspace, stream));
  } else {
    launch_for(pl.head_dim, rotate, args, int(tiles), stream);
  }
  if (document_tiles != nullptr) FLAMIA_CUDA_CHECK(cudaFreeAsync(document_tiles, stream));
  if (fused_tiles) return;
  for (int i = 0; i < num_ops; ++i) {
    const DeviceE4M3Operand& dst = *jobs[i].dst;
    sm90::quant::TileCodesArgs t;
    t.exponents = dst.exponents;
    t.cu_seqlens = in.cu_seqlens;
    t.num_docs = pl.num_docs;
    t.heads = jobs[i].heads;
    t.dim = pl.head_dim;
    t.tokens = pl.tokens;
    t.tokens_padded = layout.tokens_padded;
    t.tokens_t = layout.tokens_t;
    if (writes_codes_tiles(options, jobs[i].id)) {
      t.codes = dst.codes;
      t.tiles = dst.codes_tiles;
      sm90::quant::launch_key_tile_codes(t, stream);
    }
    if (writes_codes_t_tiles(options, jobs[i].id)) {
      t.codes = dst.codes_t;
      t.tiles = dst.codes_t_tiles;
      sm90::quant::launch_value_tile_codes(t, stream);
    }
  }
}

}  // namespace flamia
