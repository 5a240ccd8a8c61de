// A small wrapper of Hopper's warpgroup MMA (wgmma.mma_async; SASS HGMMA / QGMMA) with
// operands in shared memory, K-major, 128- or 64-byte swizzled (or A in registers for e4m3):
// e4m3 x e4m3 -> f32 (m64nNk32) and bf16 x bf16 -> f32 (m64nNk16) for N in {64, 128, 256}. wgmma is
// not in cuda::ptx, so this is inline PTX written from the PTX ISA ("Asynchronous Warpgroup Level
// Matrix Instructions").
//
// Usage by the 128 threads of one warpgroup (all four warps execute every call):
//   fence();  mma_*(acc, desc_a, desc_b, accumulate) ...;  commit();  wait<0>();
//   fence_operands(acc)
// Shared operands written by ordinary stores need fence_async_shared() and a barrier first;
// operands loaded by TMA need only the completed mbarrier.
#pragma once

#include <cstdint>

#include "arch.cuh"

namespace flamia::sm90::wgmma {

constexpr int kM = 64;            // rows of A and D per instruction
constexpr uint32_t kKBytes = 32;  // bytes of K per instruction: k32 for e4m3, k16 for bf16
constexpr int kKE4m3 = 32;
constexpr int kKBf16 = 16;

// Accumulator registers per thread of an m64nN f32 tile (64 * N / 128 threads).
constexpr int acc_regs(int n) {
  return kM * n / int(kWarpgroupThreads);
}

// 128-byte swizzle (K-major): rows of 128 B; in each 1024 B-aligned group of 8 rows, the 16 B chunk
// c of row r is stored at chunk c ^ (r % 8). TMA's SWIZZLE_128B mode writes the same pattern.
constexpr uint32_t kSw128RowBytes = 128;
constexpr uint32_t kSw128ChunkBytes = 16;
constexpr uint32_t kSw128AtomRows = 8;
constexpr uint32_t kSw128AtomBytes = kSw128RowBytes * kSw128AtomRows;  // tile bases align to this

// Byte offset of (row, byte_in_row) inside a 128B-swizzled K-major tile of 128 B rows.
__host__ __device__ constexpr uint32_t sw128_offset(uint32_t row, uint32_t byte_in_row) {
  return row * kSw128RowBytes +
         ((byte_in_row / kSw128ChunkBytes) ^ (row % kSw128AtomRows)) * kSw128ChunkBytes +
         byte_in_row % kSw128ChunkBytes;
}

// Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): bits 13:0 start address,
// 29:16 leading byte offset, 45:32 stride byte offset, 51:49 base offset, 63:62 layout type;
// addresses and offsets are encoded as (x & 0x3FFFF) >> 4.
constexpr uint32_t kDescAddrMask = 0x3FFFF;
constexpr uint32_t kDescEncodeShift = 4;
constexpr int kDescLboShift = 16;
constexpr int kDescSboShift = 32;
constexpr int kDescLayoutShift = 62;
constexpr uint64_t kDescLayoutSw128 = 1;
// K-major swizzled layouts ignore the leading byte offset ("assumed 1").
constexpr uint64_t kDescLboUnused = 1;

__host__ __device__ constexpr uint64_t desc_encode(uint32_t x) {
  return (x & kDescAddrMask) >> kDescEncodeShift;
}

// 64-byte swizzle (K-major): rows of 64 B; in each 512 B-aligned group of 8 rows, the 16 B chunk c
// of row r is stored at chunk c ^ ((r / 2) % 4) (TMA's SWIZZLE_64B: address bits 4-5 XOR bits 7-8).
// Tiles whose K extent is 64 bytes (the backward's 64-query E4M3 operands) use it.
constexpr uint32_t kSw64RowBytes = 64;
constexpr uint32_t kSw64AtomBytes = kSw64RowBytes * kSw128AtomRows;
constexpr uint64_t kDescLayoutSw64 = 2;

__host__ __device__ constexpr uint32_t sw64_offset(uint32_t row, uint32_t byte_in_row) {
  return row * kSw64RowBytes +
         ((byte_in_row / kSw128ChunkBytes) ^ ((row / 2) % 4)) * kSw128ChunkBytes +
         byte_in_row % kSw128ChunkBytes;
}

// A kernel's shared storage at the first kSw128AtomBytes boundary of its dynamic shared memory
// (which is only 16 B aligned; the kernel allocates kSw128AtomBytes of slack). Aligned by pointer
// arithmetic on `raw` (not through an integer), so the compiler still knows every access is to
// shared memory and emits LDS/STS rather than generic loads.
template <typename Storage>
__device__ __forceinline__ Storage& sw128_aligned_storage(uint8_t* raw) {
  const uint32_t misalign = static_cast<uint32_t>(__cvta_generic_to_shared(raw)) % kSw128AtomBytes;
  return *reinterpret_cast<Storage*>(raw + (kSw128AtomBytes - misalign) % kSw128AtomBytes);
}

// Descriptor of a K-major 128B-swizzled tile whose base is kSw128AtomBytes-aligned (so the base
// offset field is 0): 8-row groups sit kSw128AtomBytes apart.
__device__ __forceinline__ uint64_t make_desc_sw128(const void* smem_tile) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_tile));
  return desc_encode(addr) | (kDescLboUnused << kDescLboShift) |
         (desc_encode(kSw128AtomBytes) << kDescSboShift) | (kDescLayoutSw128 << kDescLayoutShift);
}

// The same for a 64B-swizzled tile (base kSw64AtomBytes-aligned): 8-row groups sit kSw64AtomBytes
// apart.
__device__ __forceinline__ uint64_t make_desc_sw64(const void* smem_tile) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_tile));
  return desc_encode(addr) | (kDescLboUnused << kDescLboShift) |
         (desc_encode(kSw64AtomBytes) << kDescSboShift) | (kDescLayoutSw64 << kDescLayoutShift);
}

// The descriptor of the same tile `bytes` further along K (a multiple of 16 inside the 128 B row):
// the hardware applies the swizzle to the computed address, so stepping the start is enough.
__host__ __device__ constexpr uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> kDescEncodeShift);
}

// Accumulator fragment of an m64nN f32 tile (PTX ISA "Register Fragments", wgmma .m64nNk*):
// register i of warpgroup thread t holds D(acc_row(t, i), acc_col(t, i)).
__host__ __device__ constexpr int acc_row(int t, int i) {
  return 16 * (t / 32) + (t % 32) / 4 + 8 * ((i >> 1) & 1);
}
__host__ __device__ constexpr int acc_col(int t, int i) {
  return 8 * (i >> 2) + 2 * (t % 4) + (i & 1);
}

// Orders register accesses before the following wgmma (all warps of the warpgroup).
__device__ __forceinline__ void fence() {
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}

// Closes the group of wgmmas issued since the last commit.
__device__ __forceinline__ void commit() {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// Waits until at most `Pending` committed groups are in flight.
template <int Pending>
__device__ __forceinline__ void wait() {
  static_assert(Pending >= 0, "wait_group count is non-negative");
  asm volatile("wgmma.wait_group.sync.aligned %0;" : : "n"(Pending) : "memory");
}

// Pins the accumulators at this point of the instruction stream: without it the compiler may move
// reads of registers that an in-flight wgmma still writes across the (register-agnostic) wait.
template <int Regs>
__device__ __forceinline__ void fence_operands(float (&d)[Regs]) {
#pragma unroll
  for (int i = 0; i < Regs; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Waits for every committed group, then pins the accumulators they write.
template <int Regs>
__device__ __forceinline__ void wait_all(float (&d)[Regs]) {
  wait<0>();
  fence_operands(d);
}

namespace detail {

#define FLAMIA_WGMMA_REGS32                  \
  "{"                                        \
  "%0, %1, %2, %3, %4, %5, %6, %7, "         \
  "%8, %9, %10, %11, %12, %13, %14, %15, "   \
  "%16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31"   \
  "}"

#define FLAMIA_WGMMA_REGS64                  \
  "{"                                        \
  "%0, %1, %2, %3, %4, %5, %6, %7, "         \
  "%8, %9, %10, %11, %12, %13, %14, %15, "   \
  "%16, %17, %18, %19, %20, %21, %22, %23, " \
  "%24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, " \
  "%40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, " \
  "%56, %57, %58, %59, %60, %61, %62, %63"   \
  "}"

#define FLAMIA_WGMMA_REGS128                         \
  "{"                                                \
  "%0, %1, %2, %3, %4, %5, %6, %7, "                 \
  "%8, %9, %10, %11, %12, %13, %14, %15, "           \
  "%16, %17, %18, %19, %20, %21, %22, %23, "         \
  "%24, %25, %26, %27, %28, %29, %30, %31, "         \
  "%32, %33, %34, %35, %36, %37, %38, %39, "         \
  "%40, %41, %42, %43, %44, %45, %46, %47, "         \
  "%48, %49, %50, %51, %52, %53, %54, %55, "         \
  "%56, %57, %58, %59, %60, %61, %62, %63, "         \
  "%64, %65, %66, %67, %68, %69, %70, %71, "         \
  "%72, %73, %74, %75, %76, %77, %78, %79, "         \
  "%80, %81, %82, %83, %84, %85, %86, %87, "         \
  "%88, %89, %90, %91, %92, %93, %94, %95, "         \
  "%96, %97, %98, %99, %100, %101, %102, %103, "     \
  "%104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, " \
  "%120, %121, %122, %123, %124, %125, %126, %127"   \
  "}"

#define FLAMIA_WGMMA_ACC8(d, i)                                                               \
  "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
      "+f"(d[i + 6]), "+f"(d[i + 7])
#define FLAMIA_WGMMA_ACC32(d)                                                 \
  FLAMIA_WGMMA_ACC8(d, 0), FLAMIA_WGMMA_ACC8(d, 8), FLAMIA_WGMMA_ACC8(d, 16), \
      FLAMIA_WGMMA_ACC8(d, 24)
#define FLAMIA_WGMMA_ACC64(d)                                                       \
  FLAMIA_WGMMA_ACC8(d, 0), FLAMIA_WGMMA_ACC8(d, 8), FLAMIA_WGMMA_ACC8(d, 16),       \
      FLAMIA_WGMMA_ACC8(d, 24), FLAMIA_WGMMA_ACC8(d, 32), FLAMIA_WGMMA_ACC8(d, 40), \
      FLAMIA_WGMMA_ACC8(d, 48), FLAMIA_WGMMA_ACC8(d, 56)
#define FLAMIA_WGMMA_ACC128(d)                                                        \
  FLAMIA_WGMMA_ACC8(d, 0), FLAMIA_WGMMA_ACC8(d, 8), FLAMIA_WGMMA_ACC8(d, 16),         \
      FLAMIA_WGMMA_ACC8(d, 24), FLAMIA_WGMMA_ACC8(d, 32), FLAMIA_WGMMA_ACC8(d, 40),   \
      FLAMIA_WGMMA_ACC8(d, 48), FLAMIA_WGMMA_ACC8(d, 56), FLAMIA_WGMMA_ACC8(d, 64),   \
      FLAMIA_WGMMA_ACC8(d, 72), FLAMIA_WGMMA_ACC8(d, 80), FLAMIA_WGMMA_ACC8(d, 88),   \
      FLAMIA_WGMMA_ACC8(d, 96), FLAMIA_WGMMA_ACC8(d, 104), FLAMIA_WGMMA_ACC8(d, 112), \
      FLAMIA_WGMMA_ACC8(d, 120)

// scale_d = 0: D = A·B (the accumulator's old value is ignored); 1: D = A·B + D.
__device__ __forceinline__ void mma_e4m3_n64(float (&d)[32], uint64_t a, uint64_t b,
                                             uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " FLAMIA_WGMMA_REGS32
      ", %32, %33, p, 1, 1;\n}\n"
      : FLAMIA_WGMMA_ACC32(d)
      : "l"(a), "l"(b), "r"(scale_d));
}

__device__ __forceinline__ void mma_e4m3_n128(float (&d)[64], uint64_t a, uint64_t b,
                                              uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " FLAMIA_WGMMA_REGS64
      ", %64, %65, p, 1, 1;\n}\n"
      : FLAMIA_WGMMA_ACC64(d)
      : "l"(a), "l"(b), "r"(scale_d));
}

__device__ __forceinline__ void mma_e4m3_n256(float (&d)[128], uint64_t a, uint64_t b,
                                              uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3 " FLAMIA_WGMMA_REGS128
      ", %128, %129, p, 1, 1;\n}\n"
      : FLAMIA_WGMMA_ACC128(d)
      : "l"(a), "l"(b), "r"(scale_d));
}

__device__ __forceinline__ void mma_bf16_n64(float (&d)[32], uint64_t a, uint64_t b,
                                             uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " FLAMIA_WGMMA_REGS32
      ", %32, %33, p, 1, 1, 0, 0;\n}\n"
      : FLAMIA_WGMMA_ACC32(d)
      : "l"(a), "l"(b), "r"(scale_d));
}

__device__ __forceinline__ void mma_bf16_n128(float (&d)[64], uint64_t a, uint64_t b,
                                              uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 " FLAMIA_WGMMA_REGS64
      ", %64, %65, p, 1, 1, 0, 0;\n}\n"
      : FLAMIA_WGMMA_ACC64(d)
      : "l"(a), "l"(b), "r"(scale_d));
}

__device__ __forceinline__ void mma_bf16_n256(float (&d)[128], uint64_t a, uint64_t b,
                                              uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 " FLAMIA_WGMMA_REGS128
      ", %128, %129, p, 1, 1, 0, 0;\n}\n"
      : FLAMIA_WGMMA_ACC128(d)
      : "l"(a), "l"(b), "r"(scale_d));
}

// Register-A form: A is 4 b32 registers per thread (the m64k32 e4m3 A fragment, PTX ISA "Register
// Fragments"), B from shared memory. FP8 has no transpose immediates in either form.
__device__ __forceinline__ void mma_e4m3_rs_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t b,
                                                 uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " FLAMIA_WGMMA_REGS64
      ", {%64, %65, %66, %67}, %68, p, 1, 1;\n}\n"
      : FLAMIA_WGMMA_ACC64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

__device__ __forceinline__ void mma_e4m3_rs_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t b,
                                                uint32_t scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 " FLAMIA_WGMMA_REGS32
      ", {%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
      : FLAMIA_WGMMA_ACC32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(scale_d));
}

#undef FLAMIA_WGMMA_ACC8
#undef FLAMIA_WGMMA_ACC32
#undef FLAMIA_WGMMA_ACC64
#undef FLAMIA_WGMMA_ACC128
#undef FLAMIA_WGMMA_REGS32
#undef FLAMIA_WGMMA_REGS64
#undef FLAMIA_WGMMA_REGS128

}  // namespace detail

// D[64, N] (+)= A[64, 32] · B[N, 32]^T, e4m3 codes, f32 accumulators; `accumulate` false
// overwrites D.
template <int N>
__device__ __forceinline__ void mma_e4m3(float (&d)[acc_regs(N)], uint64_t desc_a, uint64_t desc_b,
                                         bool accumulate) {
  static_assert(N == 64 || N == 128 || N == 256, "wgmma e4m3: N in {64, 128, 256}");
  if constexpr (N == 64) detail::mma_e4m3_n64(d, desc_a, desc_b, accumulate);
  if constexpr (N == 128) detail::mma_e4m3_n128(d, desc_a, desc_b, accumulate);
  if constexpr (N == 256) detail::mma_e4m3_n256(d, desc_a, desc_b, accumulate);
}

// D[64, N] (+)= A[64, 32] · B[N, 32]^T with A from registers: byte b of a[j] is A(row r + 8 (j &
// 1), k = 4 (t % 4) + b + 16 (j >> 1)), r = acc_row(t, 0) (a_frag_row / a_frag_k below).
template <int N>
__device__ __forceinline__ void mma_e4m3_rs(float (&d)[acc_regs(N)], const uint32_t (&a)[4],
                                            uint64_t desc_b, bool accumulate) {
  static_assert(N == 64 || N == 128,
                "wgmma e4m3 register-A: N in {64, 128} (add shapes as kernels need them)");
  if constexpr (N == 64) detail::mma_e4m3_rs_n64(d, a, desc_b, accumulate);
  if constexpr (N == 128) detail::mma_e4m3_rs_n128(d, a, desc_b, accumulate);
}

// The e4m3 register A fragment of m64k32: byte b of register j of warpgroup thread t.
__host__ __device__ constexpr int a_frag_row(int t, int j) {
  return 16 * (t / 32) + (t % 32) / 4 + 8 * (j & 1);
}
__host__ __device__ constexpr int a_frag_k(int t, int j, int b) {
  return 4 * (t % 4) + b + 16 * (j >> 1);
}

// D[64, N] (+)= A[64, 16] · B[N, 16]^T, bf16, f32 accumulators, both operands K-major.
template <int N>
__device__ __forceinline__ void mma_bf16(float (&d)[acc_regs(N)], uint64_t desc_a, uint64_t desc_b,
                                         bool accumulate) {
  static_assert(N == 64 || N == 128 || N == 256, "wgmma bf16: N in {64, 128, 256}");
  if constexpr (N == 64) detail::mma_bf16_n64(d, desc_a, desc_b, accumulate);
  if constexpr (N == 128) detail::mma_bf16_n128(d, desc_a, desc_b, accumulate);
  if constexpr (N == 256) detail::mma_bf16_n256(d, desc_a, desc_b, accumulate);
}

}  // namespace flamia::sm90::wgmma
