#include "gpu_test.h"

namespace flamia {
namespace {

TEST(GpuDevice, ReportsAHopperDevice) {
  FLAMIA_REQUIRE_GPU();
  DeviceInfo info = query_device();
  EXPECT_EQ(info.sm_major, 9);
  EXPECT_GT(info.multiprocessors, 0);
  EXPECT_EQ(info.uuid.rfind("GPU-", 0), 0u) << info.uuid;
  EXPECT_EQ(info.uuid.size(), 40u) << info.uuid;
  EXPECT_TRUE(built_with_cuda());
}

}  // namespace
}  // namespace flamia
