// Shared by the GPU tests: skip (never pass vacuously) without a usable sm_90 device.
#pragma once

#include <gtest/gtest.h>

#include <functional>
#include <string>

#include "flamia/common.h"

#include "flamia/device.h"

#define FLAMIA_REQUIRE_GPU()                                                         \
  do {                                                                               \
    static const ::flamia::DeviceInfo flamia_device_info = ::flamia::query_device(); \
    if (!flamia_device_info.available) GTEST_SKIP() << flamia_device_info.reason;    \
  } while (0)

namespace flamia::test {

// f() must throw flamia::Error whose message contains `fragment`.
inline void expect_error(const std::function<void()>& f, const std::string& fragment) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one mentioning '" << fragment << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

}  // namespace flamia::test
