// CPU emulator of the microscaled attention algorithm (DESIGN §4), structured like the kernels:
// per (document, query head) query tile x key tile in the forward, per (document, head) key tile
// x query tiles from the diagonal in the backward, tile sizes as parameters. It computes exactly
// the kernels' algorithm with exact exp2 and a fixed FP32 summation order, so GPU-vs-emulator
// tests compare within tolerances while the emulator-vs-FP64 error is the algorithm's own.
//
// Forward, per query row i (document-relative) and visible key tile, the tiles from the last
// (the causal diagonal, or the one holding the document's end) down to the first:
//   t_ij = (S_ij * (log2(e) * scale * 2^eq_i)) * 2^ek_j          S from unscaled operand values
//   mask (document, causal) after scaling; m_i = running max of t; P_ij = 2^(t_ij - m_i + 8) <= 2^8
//   R_i = running max of the visible e_v(j);  P~_ij = P_ij * 2^(e_v(j) - R_i) <= 2^8 <= 448
//   except in a key tile that every row of the kernel's item sees (items end-aligned as the
//   kernel's work list, scheduler.h): there V's tile codes (flamia/quantize.h) carry
//   2^(e_v(j) - T), T the tile's largest e_v, and P~_ij = P_ij * 2^(T - R_i); with mxfp8, S is on
//   K's tile codes too and e_k(j) is the tile's largest e_k, in both passes
//   P~ rounded to E4M3 (BF16 for the bf16 recipe); O tile = P~ V in fresh FP32 registers, added to
//   the running O after the rescale 2^(m_old - m_new) * 2^(R_old - R_new);  l_i = sum of unrounded
//   P O_i = O * (2^R_i / l_i) -> BF16;  LSE_i = ln(2) * (m_i - 8 + log2 l_i)
// Backward, per key tile and query tile:
//   t recomputed identically; P = 2^(t - LSE_i log2 e); dP = (dO V^T)_ij 2^(eg_i + ev_j)
//   D_i = sum_d dequant(dO_q)_id * O_id (the forward's BF16 O);  dS = P (dP - D)
//   dV += 2^(C - 8) * E4M3(P * 2^(eg_i - C + 8))^T dO_codes       C = max eg over the tile's rows
//   dQ += 2^er_i * E4M3(dS * 2^ek_j / 2^er_i) K_codes   er_i: row scale over the tile's visible
//   keys dK += 2^ec_j * E4M3(dS * 2^eq_i / 2^ec_j)^T Q_codes  ec_j: column scale over the tile's
//   rows dQ partials summed in key-tile order in FP32; dQ, dK scaled by `scale` at the end; GQA
//   sums dK, dV over a group's query heads; with Hadamard rotation dQ and dK are rotated back;
//   outputs BF16.
// Scale exponents are rounded up (no clamp). vgroup16's V has per-channel scales, which cannot be
// folded into P: it is dequantized in the products (the Blackwell in-MMA scaling, as a baseline).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "flamia/attention.h"
#include "flamia/inputs.h"
#include "flamia/quantize.h"

namespace flamia {

struct TileShape {
  int block_m = 128;  // query rows per tile
  int block_n = 128;  // keys per tile
};

constexpr int kPOffsetLog2 = 8;  // P <= 2^8 before the V fold: within E4M3's 448 with headroom

struct EmulatorConfig {
  Recipe recipe = Recipe::kMxfp8;
  ScalePolicy policy = ScalePolicy::kToken;
  bool hadamard = false;
  AttentionConfig attention;
  TileShape forward{128, 128};
  TileShape backward{64, 128};
  bool backward_pass = true;
};

struct EmulatorStats {
  int64_t p_entries = 0;     // visible forward P~ entries
  int64_t p_underflow = 0;   // nonzero P~ rounded to zero
  double p_max = 0.0;        // largest P~ before rounding (the E4M3 budget: must stay <= 448)
  int64_t ds_entries = 0;    // visible dS entries in the backward
  int64_t ds_nonzero = 0;    // of which nonzero before quantization
  int64_t ds_zero_dq = 0;    // nonzero dS rounded to zero in dQ's quantization
  int64_t ds_zero_dk = 0;    // ... in dK's quantization
  int64_t pt_underflow = 0;  // nonzero P^T entries of dV's product rounded to zero
  std::array<int64_t, kNumOperands> operand_nonzero{};    // nonzero input elements
  std::array<int64_t, kNumOperands> operand_underflow{};  // of which quantized to zero
  std::vector<double> row_residual;  // |sum_j dS_ij| / sum_j |dS_ij| per (head, row), dS != 0
};

struct EmulatorResult {
  AttentionOutputs<float> out;  // O, dQ, dK, dV hold BF16 values; LSE in FP32
  EmulatorStats stats;
};

// Throws Error on invalid inputs, on non-finite inputs (naming tensor and position), and if the
// E4M3 budget of P~ were ever exceeded.
EmulatorResult emulate(const AttentionBatch& batch, const EmulatorConfig& config);

}  // namespace flamia
