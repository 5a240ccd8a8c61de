#include "gpu_test.h"

namespace flamia {
namespace {

TEST(GpuDevice, ReportsAHopperDevice) {
  FLAMIA_REQUIRE_GPU();
  DeviceInfo info = query_device();
  EXPECT_EQ(info.sm_major, 9);
  EXPECT_GT(info.multiprocessors, 0);
  EXPECT_TRUE(built_with_cuda());
}

}  // namespace
}  // namespace flamia
