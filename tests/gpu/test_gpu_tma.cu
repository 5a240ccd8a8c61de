// TMA primitives: tile loads (2D, 3D, unaligned and out-of-bounds starts, 128B swizzle), tile
// stores, plain bulk copies, and the host-side validation of tensor maps.
#include <cstdint>
#include <random>
#include <vector>

#include "gpu_test.h"
#include "mbarrier.cuh"
#include "proxy_fence.cuh"
#include "sm90_test_util.h"
#include "tma.cuh"
#include "wgmma.cuh"

namespace flamia {
namespace {

using sm90::make_tensor_map_2d;
using test::DeviceBuffer;

constexpr int kThreads = 128;
constexpr uint32_t kTileCapacity = 16 * 1024;  // bytes of shared tile in the test kernels
constexpr uint32_t kSmemAlign = 1024;          // what 128B-swizzled tiles need

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> dist(0, 255);
  std::vector<uint8_t> v(n);
  for (auto& x : v) x = uint8_t(dist(rng));
  return v;
}

// Loads one box at coords (c0, c1[, c2]) and copies the raw shared bytes to `out`.
__global__ void load_box_kernel(const __grid_constant__ CUtensorMap map, int rank, int c0, int c1,
                                int c2, uint32_t box_bytes, uint8_t* out) {
  __shared__ alignas(kSmemAlign) uint8_t tile[kTileCapacity];
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    sm90::mbarrier_init(&bar, 1);
    sm90::mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sm90::mbarrier_arrive_expect_tx(&bar, box_bytes);
    if (rank == 2) {
      sm90::tma_load_2d(tile, &map, c0, c1, &bar);
    } else {
      sm90::tma_load_3d(tile, &map, c0, c1, c2, &bar);
    }
  }
  sm90::mbarrier_wait(&bar, 0);
  for (uint32_t i = threadIdx.x; i < box_bytes; i += blockDim.x) out[i] = tile[i];
}

std::vector<uint8_t> load_box(const CUtensorMap& map, int rank, int c0, int c1, int c2,
                              uint32_t box_bytes) {
  DeviceBuffer<uint8_t> out(box_bytes);
  out.poison();
  load_box_kernel<<<1, kThreads>>>(map, rank, c0, c1, c2, box_bytes, out.get());
  test::sync_checked();
  return out.download();
}

TEST(GpuTma, LoadTileAtUnalignedRowOffsetEqualsSource) {
  FLAMIA_REQUIRE_GPU();
  constexpr int kRows = 100, kCols = 192;
  constexpr uint32_t kBoxCols = 64, kBoxRows = 32;
  const std::vector<uint8_t> src = random_bytes(kRows * kCols, 1);
  DeviceBuffer<uint8_t> d_src(src);
  const CUtensorMap map = make_tensor_map_2d(d_src.get(), CU_TENSOR_MAP_DATA_TYPE_UINT8, kCols,
                                             kRows, kCols, kBoxCols, kBoxRows);
  for (int row0 : {13, 1, 67}) {
    const int col0 = 32;
    const std::vector<uint8_t> got = load_box(map, 2, col0, row0, 0, kBoxCols * kBoxRows);
    for (uint32_t r = 0; r < kBoxRows; ++r)
      for (uint32_t c = 0; c < kBoxCols; ++c)
        ASSERT_EQ(got[r * kBoxCols + c], src[(row0 + r) * kCols + col0 + c])
            << "row0 " << row0 << " r " << r << " c " << c;
  }
}

TEST(GpuTma, OutOfBoundsElementsReadAsZero) {
  FLAMIA_REQUIRE_GPU();
  constexpr int kRows = 40, kCols = 48;
  constexpr uint32_t kBoxCols = 32, kBoxRows = 16;
  std::vector<uint8_t> src = random_bytes(kRows * kCols, 2);
  for (auto& x : src) x |= 1;  // no zero in the source, so a zero can only be fill
  DeviceBuffer<uint8_t> d_src(src);
  const CUtensorMap map = make_tensor_map_2d(d_src.get(), CU_TENSOR_MAP_DATA_TYPE_UINT8, kCols,
                                             kRows, kCols, kBoxCols, kBoxRows);
  // Overhanging the last row and column, and starting before the first row.
  for (auto [col0, row0] : {std::pair{32, 30}, std::pair{0, -5}}) {
    const std::vector<uint8_t> got = load_box(map, 2, col0, row0, 0, kBoxCols * kBoxRows);
    for (int r = 0; r < int(kBoxRows); ++r) {
      for (int c = 0; c < int(kBoxCols); ++c) {
        const int gr = row0 + r, gc = col0 + c;
        const bool inside = gr >= 0 && gr < kRows && gc >= 0 && gc < kCols;
        ASSERT_EQ(got[r * kBoxCols + c], inside ? src[gr * kCols + gc] : 0)
            << "row " << gr << " col " << gc;
      }
    }
  }
}

TEST(GpuTma, Swizzle128BMatchesTheWgmmaLayout) {
  FLAMIA_REQUIRE_GPU();
  constexpr int kRows = 64, kCols = 256;
  constexpr uint32_t kBoxCols = 128, kBoxRows = 24;  // 128 B rows: one swizzle span
  const std::vector<uint8_t> src = random_bytes(kRows * kCols, 3);
  DeviceBuffer<uint8_t> d_src(src);
  const CUtensorMap map =
      make_tensor_map_2d(d_src.get(), CU_TENSOR_MAP_DATA_TYPE_UINT8, kCols, kRows, kCols, kBoxCols,
                         kBoxRows, CU_TENSOR_MAP_SWIZZLE_128B);
  const int row0 = 7, col0 = 128;
  const std::vector<uint8_t> got = load_box(map, 2, col0, row0, 0, kBoxCols * kBoxRows);
  for (uint32_t r = 0; r < kBoxRows; ++r)
    for (uint32_t c = 0; c < kBoxCols; ++c)
      ASSERT_EQ(got[sm90::wgmma::sw128_offset(r, c)], src[(row0 + r) * kCols + col0 + c])
          << "r " << r << " c " << c;
}

TEST(GpuTma, Load3DBoxOfTwoByteElements) {
  FLAMIA_REQUIRE_GPU();
  constexpr uint64_t kD0 = 48, kD1 = 40, kD2 = 6;
  constexpr uint32_t kB0 = 16, kB1 = 8, kB2 = 3;
  std::vector<uint16_t> src(kD0 * kD1 * kD2);
  for (size_t i = 0; i < src.size(); ++i) src[i] = uint16_t(i * 7 + 3);
  DeviceBuffer<uint16_t> d_src(src);
  const CUtensorMap map = sm90::make_tensor_map_3d(
      d_src.get(), CU_TENSOR_MAP_DATA_TYPE_UINT16, {kD0, kD1, kD2},
      {kD0 * sizeof(uint16_t), kD0 * kD1 * sizeof(uint16_t)}, {kB0, kB1, kB2});
  const int c0 = 8, c1 = 5, c2 = 2;
  const std::vector<uint8_t> raw = load_box(map, 3, c0, c1, c2, kB0 * kB1 * kB2 * sizeof(uint16_t));
  for (uint32_t z = 0; z < kB2; ++z)
    for (uint32_t y = 0; y < kB1; ++y)
      for (uint32_t x = 0; x < kB0; ++x) {
        const size_t i = (z * kB1 + y) * kB0 + x;
        const uint16_t got = uint16_t(raw[2 * i] | raw[2 * i + 1] << 8);
        ASSERT_EQ(got, src[((c2 + z) * kD1 + c1 + y) * kD0 + c0 + x]) << z << "," << y << "," << x;
      }
}

// Threads fill a box with a pattern and TMA stores it at (c0, c1).
__global__ void store_box_kernel(const __grid_constant__ CUtensorMap map, int c0, int c1,
                                 uint32_t box_bytes) {
  __shared__ alignas(kSmemAlign) uint8_t tile[kTileCapacity];
  for (uint32_t i = threadIdx.x; i < box_bytes; i += blockDim.x) tile[i] = uint8_t(i * 13 + 1);
  sm90::fence_async_shared();  // generic writes -> the TMA engine's reads
  __syncthreads();
  if (threadIdx.x == 0) {
    sm90::tma_store_2d(&map, c0, c1, tile);
    sm90::tma_store_commit();
    sm90::tma_store_wait<0>();
  }
}

TEST(GpuTma, StoreWritesExactlyTheBoxInsideTheTensor) {
  FLAMIA_REQUIRE_GPU();
  constexpr int kRows = 50, kCols = 96;
  constexpr uint32_t kBoxCols = 32, kBoxRows = 16;
  DeviceBuffer<uint8_t> dst(kRows * kCols);
  const CUtensorMap map = make_tensor_map_2d(dst.get(), CU_TENSOR_MAP_DATA_TYPE_UINT8, kCols, kRows,
                                             kCols, kBoxCols, kBoxRows);
  // An interior box at an odd row, and one overhanging the bottom-right corner.
  for (auto [col0, row0] : {std::pair{16, 11}, std::pair{80, 42}}) {
    dst.poison(0);
    store_box_kernel<<<1, kThreads>>>(map, col0, row0, kBoxCols * kBoxRows);
    test::sync_checked();
    const std::vector<uint8_t> got = dst.download();
    for (int r = 0; r < kRows; ++r) {
      for (int c = 0; c < kCols; ++c) {
        const int br = r - row0, bc = c - col0;
        const bool in_box = br >= 0 && br < int(kBoxRows) && bc >= 0 && bc < int(kBoxCols);
        const uint8_t want = in_box ? uint8_t((br * kBoxCols + bc) * 13 + 1) : 0;
        ASSERT_EQ(got[r * kCols + c], want) << "row " << r << " col " << c;
      }
    }
  }
}

// Plain bulk copy global -> shared (mbarrier) -> global (bulk group).
__global__ void bulk_round_trip_kernel(const uint8_t* src, uint8_t* dst, uint32_t bytes) {
  __shared__ alignas(kSmemAlign) uint8_t buf[kTileCapacity];
  __shared__ uint64_t bar;
  if (threadIdx.x == 0) {
    sm90::mbarrier_init(&bar, 1);
    sm90::mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    sm90::mbarrier_arrive_expect_tx(&bar, bytes);
    sm90::bulk_load(buf, src, bytes, &bar);
    sm90::mbarrier_wait(&bar, 0);
    sm90::bulk_store(dst, buf, bytes);
    sm90::tma_store_commit();
    sm90::tma_store_wait<0>();
  }
}

TEST(GpuTma, BulkCopyRoundTrip) {
  FLAMIA_REQUIRE_GPU();
  constexpr uint32_t kBytes = 12 * 1024 + 48;  // a multiple of 16, not of a power of two
  constexpr uint32_t kSlack = 64;
  const std::vector<uint8_t> src = random_bytes(kBytes, 4);
  DeviceBuffer<uint8_t> d_src(src);
  DeviceBuffer<uint8_t> dst(kBytes + kSlack);
  dst.poison(0);
  bulk_round_trip_kernel<<<1, kThreads>>>(d_src.get(), dst.get(), kBytes);
  test::sync_checked();
  const std::vector<uint8_t> got = dst.download();
  for (uint32_t i = 0; i < kBytes; ++i) ASSERT_EQ(got[i], src[i]) << i;
  for (uint32_t i = kBytes; i < kBytes + kSlack; ++i) ASSERT_EQ(got[i], 0) << "overrun at " << i;
}

TEST(GpuTma, TensorMapValidationRejectsBadGeometry) {
  FLAMIA_REQUIRE_GPU();
  constexpr int kRows = 64, kCols = 256;
  DeviceBuffer<uint8_t> buf(kRows * kCols + 16);
  const auto u8 = CU_TENSOR_MAP_DATA_TYPE_UINT8;
  // Base address off by one byte.
  EXPECT_THROW(make_tensor_map_2d(buf.get() + 1, u8, kCols, kRows, kCols, 64, 8), Error);
  // Row stride not a multiple of 16.
  EXPECT_THROW(make_tensor_map_2d(buf.get(), u8, 100, kRows, 100, 64, 8), Error);
  // Box dimension over 256.
  EXPECT_THROW(make_tensor_map_2d(buf.get(), u8, kCols, kRows, kCols, 64, 300), Error);
  // Box inner extent not a multiple of 16 B.
  EXPECT_THROW(make_tensor_map_2d(buf.get(), u8, kCols, kRows, kCols, 40, 8), Error);
  // 256 B box rows under a 128 B swizzle.
  EXPECT_THROW(
      make_tensor_map_2d(buf.get(), u8, kCols, kRows, kCols, 256, 8, CU_TENSOR_MAP_SWIZZLE_128B),
      Error);
  // And the valid neighbour of each encodes.
  EXPECT_NO_THROW(
      make_tensor_map_2d(buf.get(), u8, kCols, kRows, kCols, 128, 8, CU_TENSOR_MAP_SWIZZLE_128B));
}

}  // namespace
}  // namespace flamia
