// The device query's host-side parts: the UUID's text form, and a report that says why a device
// is unusable.
#include <gtest/gtest.h>

#include "flamia/device.h"

namespace flamia {
namespace {

TEST(Device, UuidInNvidiaSmiForm) {
  unsigned char bytes[16];
  for (int i = 0; i < 16; ++i) bytes[i] = static_cast<unsigned char>(0x10 * i + (15 - i));
  EXPECT_EQ(gpu_uuid_string(bytes), "GPU-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0");
  unsigned char ends[16] = {0xff, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x01};
  EXPECT_EQ(gpu_uuid_string(ends), "GPU-ff000000-0000-0000-0000-000000000001");
}

TEST(Device, QueryExplainsAnUnusableDevice) {
  const DeviceInfo info = query_device();
  if (info.available) {
    EXPECT_EQ(info.uuid.size(), 40u) << info.uuid;
    EXPECT_TRUE(info.reason.empty()) << info.reason;
  } else {
    EXPECT_FALSE(info.reason.empty());
  }
}

}  // namespace
}  // namespace flamia
